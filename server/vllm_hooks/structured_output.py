"""vLLM's structured-output backend: the door's compile check (API process), and no compiled grammars kept
(every process).

The engine core compiles a request's grammar while scheduling it; a grammar its backend cannot compile
raises there. :func:`xgrammar_compiler` compiles the same constraint with vLLM's own xgrammar backend before
the request reaches the engine. :func:`forget_compiled_grammars` keeps the backend from keeping compiled
grammars, in the engine core (plugin ``vlguard_grammar_cache``) and for the door. Targets
(``vllm.v1.structured_output.backend_xgrammar``, ``vllm.v1.structured_output.request``) are listed in
:data:`server.vllm_hooks.TARGETS`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import cachetools

from server.vllm_hooks import wrap

logger = logging.getLogger(__name__)

#: The longest compile error message kept and answered (the backend's messages may quote the whole constraint).
MESSAGE_CHARS = 1000


def forget_compiled_grammars() -> None:
    """Replace ``XgrammarBackend.compile_grammar(self, ...)`` by one that empties the backend's compiler
    cache (xgrammar's cache of compiled grammars) after each compile, in this process (once).

    The cache is bounded by ``VLLM_XGRAMMAR_CACHE_MB`` (512 by default), but the process is not: on the
    0.20 lane, 700 distinct 3 KB regexes, one request each, grew the engine core's processes from 2936 to
    4044 MB, and xgrammar's compiler alone with a 64 MB limit grew past 600 MB over 600 regexes and gave
    nothing back when cleared later; emptied after each compile it stayed within 5 MB over 300. One client
    could so grow the engine core until the OOM killer ended it with every request. A typical JSON schema
    compiles in ~1.2 ms afresh against ~0.6 ms from the cache (the matcher included): each constraint is
    compiled afresh.

    Raises:
        HookTargetMissing: an unsupported vLLM version.
    """
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def compile_grammar(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, *args, **kwargs)
            finally:
                self.compiler.clear_cache()

        return compile_grammar

    wrap(XgrammarBackend, "compile_grammar", make, f"{XgrammarBackend.__module__}.XgrammarBackend.compile_grammar")


def xgrammar_compiler(
    vllm_config: Any, tokenizer: Any, vocab_size: int
) -> Callable[[dict[str, Any]], str | None] | None:
    """A compile check with vLLM's xgrammar backend over ``tokenizer``, or None when the engine compiles
    with another backend or this vLLM lacks the pieces. Results are cached per constraint (1024), keyed by
    the constraint's digest and their messages cut to :data:`MESSAGE_CHARS`: keyed by its text, 40 refused
    7 MB regexes stayed in the cache (280 MB) after their requests, outside every body bound. The
    backend keeps no compiled grammar (:func:`forget_compiled_grammars`): the door needs only the verdict.

    Returns:
        ``(constraint kwargs) -> error message or None``; blocking (compiling may take a second).
    """
    backend_name = getattr(getattr(vllm_config, "structured_outputs_config", None), "backend", "auto")
    if backend_name not in ("auto", "xgrammar"):
        return None
    try:
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, validate_xgrammar_grammar
        from vllm.v1.structured_output.request import get_structured_output_key
    except ImportError:
        logger.warning("structured-output constraints are not compiled at the door: this vLLM lacks the pieces")
        return None
    forget_compiled_grammars()
    backend: list[Any] = []  # built at the first constraint: building reads the whole vocabulary

    def compile_text(text: str) -> str | None:
        try:
            params = StructuredOutputsParams(**json.loads(text))
            validate_xgrammar_grammar(SamplingParams(structured_outputs=params))
            kind, spec = get_structured_output_key(params)
            if not backend:
                backend.append(XgrammarBackend(vllm_config, tokenizer=tokenizer, vocab_size=vocab_size))
            backend[0].compile_grammar(kind, spec)
        except Exception as exc:  # the engine core would raise the same while scheduling the request
            message = f"{type(exc).__name__}: {exc}"
            return message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 1] + "\u2026"
        return None

    # Keyed by the digest alone: the text is only read on a miss (vLLM's backend caches with cachetools too)
    @cachetools.cached(cachetools.LRUCache(maxsize=1024), key=lambda digest, text: digest, lock=threading.Lock())
    def compile_once(digest: bytes, text: str) -> str | None:
        return compile_text(text)

    def check(constraint: dict[str, Any]) -> str | None:
        text = json.dumps(constraint, sort_keys=True)
        return compile_once(hashlib.sha256(text.encode()).digest(), text)

    return check
