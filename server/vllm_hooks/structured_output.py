"""vLLM's structured-output backend, for the door's compile check (API process).

The engine core compiles a request's grammar while scheduling it; a grammar its backend cannot compile
raises there. :func:`xgrammar_compiler` compiles the same constraint with vLLM's own xgrammar backend before
the request reaches the engine (targets ``vllm.v1.structured_output.backend_xgrammar`` and
``vllm.v1.structured_output.request``, listed in :data:`server.vllm_hooks.TARGETS`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import cachetools

logger = logging.getLogger(__name__)

#: The longest compile error message kept and answered (the backend's messages may quote the whole constraint).
MESSAGE_CHARS = 1000


def xgrammar_compiler(
    vllm_config: Any, tokenizer: Any, vocab_size: int
) -> Callable[[dict[str, Any]], str | None] | None:
    """A compile check with vLLM's xgrammar backend over ``tokenizer``, or None when the engine compiles
    with another backend or this vLLM lacks the pieces. Results are cached per constraint (1024), keyed by
    the constraint's digest and their messages cut to :data:`MESSAGE_CHARS`: keyed by its text, 40 refused
    7 MB regexes stayed in the cache (280 MB) after their requests, outside every body bound. The
    backend's own cache of compiled grammars (xgrammar's, up to ``VLLM_XGRAMMAR_CACHE_MB``, 512 by default)
    is emptied after each compile: each distinct 3 KB regex left ~2 MB in it (+586 MB of memory after 300,
    not given back when the cache was cleared later), and the door needs only the verdict.

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
    backend: list[Any] = []  # built at the first constraint: building reads the whole vocabulary

    def compile_text(text: str) -> str | None:
        try:
            params = StructuredOutputsParams(**json.loads(text))
            validate_xgrammar_grammar(SamplingParams(structured_outputs=params))
            kind, spec = get_structured_output_key(params)
            if not backend:
                backend.append(XgrammarBackend(vllm_config, tokenizer=tokenizer, vocab_size=vocab_size))
            try:
                backend[0].compile_grammar(kind, spec)
            finally:  # the door keeps verdicts, not compiled grammars (see the docstring)
                with contextlib.suppress(AttributeError):
                    backend[0].compiler.clear_cache()
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
