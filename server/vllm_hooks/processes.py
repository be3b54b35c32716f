"""Hooks on how vLLM starts its engine processes (API process and engine-core process).

vLLM starts the engine core (``vllm.v1.engine.utils``) and each worker
(``vllm.v1.executor.multiproc_executor``) through the module's ``get_mp_context()``; the spare
(:mod:`server.engine.spare`) routes those starts to a process spawned ahead of time. Targets in
:data:`server.vllm_hooks.TARGETS`; checked on vLLM 0.20.0, 0.22.1, 0.32.0 and 0.34.0.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from server.vllm_hooks import wrap

#: The modules whose ``get_mp_context`` starts vLLM's engine core and its workers.
ENGINE_CORE_STARTER = "vllm.v1.engine.utils"
WORKER_STARTER = "vllm.v1.executor.multiproc_executor"


def route_starts(module_name: str, make_context: Callable[[Any], Any]) -> None:
    """Make ``module_name``'s ``get_mp_context()`` return ``make_context(<the real context>)``. Idempotent.

    Raises:
        ImportError: the module is not there; HookTargetMissing: it does not use ``get_mp_context``.
    """
    module: Any = importlib.import_module(module_name)

    def routed(original: Callable[[], Any]) -> Callable[[], Any]:
        def get_mp_context() -> Any:
            return make_context(original())

        return get_mp_context

    wrap(module, "get_mp_context", routed, f"{module_name}.get_mp_context")
