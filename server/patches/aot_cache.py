"""Backport: vLLM's AOT compile cache loads inductor artifacts (the CPU platform's) instead of recompiling.

vLLM 0.20.0, 0.22.1 and 0.32.0 finish loading a stored torch.compile artifact with
``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)``. vLLM's own backend
(``VllmSerializableFunction``) has that method; what the stock inductor backend stores, which the CPU
platform uses (compilation mode ``DYNAMO_TRACE_ONCE``), loads as torch's serializable callable around the
compiled function, which has not. The load then raises
``AttributeError``, vLLM treats it as a cache miss ("Compiling model again due to a load failure ...
'function' object has no attribute 'finalize_loading'") and compiles the model again: every start and
every engine rebuild pays the compile (measured on the tiny model, vLLM 0.20.0: 7 s of a 16.8 s rebuild;
stock vLLM's restart pays the same). There is nothing to finalize for such a function (inductor binds its
compiled code on the first call, which the warm-up makes), so the backport gives it a no-op
``finalize_loading``; vLLM's own artifacts are left as they are. Applied by wrapping
``torch.compiler.load_compiled_function`` (how vLLM loads an artifact) in the processes vLLM loads
plugins in; off with the other patches (``VLGUARD_PATCHES=off``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from server.vllm_hooks import models

logger = logging.getLogger("vllm.vlguard.patches")  # runs inside vLLM processes: use its handler

NAME = "aot_cache_inductor_load"


def _nothing_to_finalize(vllm_config: Any) -> None:
    """What ``finalize_loading`` does for an inductor-compiled function: nothing."""


def add_finalize_loading(loaded: Any) -> bool:
    """Give ``loaded`` (what ``torch.compiler.load_compiled_function`` returned) a no-op
    ``_artifacts.compiled_fn.finalize_loading`` when its compiled function lacks one.

    Returns:
        Whether it was added (False: vLLM's own artifact, or an object of another shape).
    """
    compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
    if compiled is None or hasattr(compiled, "finalize_loading"):
        return False
    try:
        compiled.finalize_loading = _nothing_to_finalize
    except (AttributeError, TypeError):  # an object that takes no attributes: leave vLLM's behaviour
        return False
    return True


def install() -> bool:
    """Wrap ``torch.compiler.load_compiled_function`` in this process
    (:func:`server.vllm_hooks.models.wrap_compiled_function_load`). Idempotent.

    Returns:
        Whether the wrapper is in place (False: this torch has no AOT load function).
    """

    def finalizing(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
            loaded = original(*args, **kwargs)
            from server.patches import enabled

            if enabled() and add_finalize_loading(loaded):
                logger.info(
                    "vlguard: %s: added the no-op finalize_loading vLLM calls on a loaded inductor artifact", NAME
                )
            return loaded

        return load_compiled_function

    return models.wrap_compiled_function_load(finalizing)
