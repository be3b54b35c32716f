"""vLLM's structured-output backend, for the door's compile check (API process).

The engine core compiles a request's grammar while scheduling it; a grammar its backend cannot compile
raises there. :func:`xgrammar_compiler` compiles the same constraint with vLLM's own xgrammar backend before
the request reaches the engine (targets ``vllm.v1.structured_output.backend_xgrammar`` and
``vllm.v1.structured_output.request``, listed in :data:`server.vllm_hooks.TARGETS`).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def xgrammar_compiler(
    vllm_config: Any, tokenizer: Any, vocab_size: int
) -> Callable[[dict[str, Any]], str | None] | None:
    """A compile check with vLLM's xgrammar backend over ``tokenizer``, or None when the engine compiles
    with another backend or this vLLM lacks the pieces. Results are cached per constraint (1024).

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

    @functools.lru_cache(maxsize=1024)
    def compile_key(key: str) -> str | None:
        try:
            params = StructuredOutputsParams(**json.loads(key))
            validate_xgrammar_grammar(SamplingParams(structured_outputs=params))
            kind, spec = get_structured_output_key(params)
            if not backend:
                backend.append(XgrammarBackend(vllm_config, tokenizer=tokenizer, vocab_size=vocab_size))
            backend[0].compile_grammar(kind, spec)
        except Exception as exc:  # the engine core would raise the same while scheduling the request
            return f"{type(exc).__name__}: {exc}"
        return None

    def check(constraint: dict[str, Any]) -> str | None:
        return compile_key(json.dumps(constraint, sort_keys=True))

    return check
