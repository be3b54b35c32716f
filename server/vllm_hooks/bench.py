"""Bench-only hooks (API process): the phase trace's stamps on vLLM's request path
(:mod:`server.workload.phase_trace`, loaded only when ``VLGUARD_PHASE_TRACE`` names a file). Serving never
calls this module; its vLLM targets are listed in :data:`server.vllm_hooks.TARGETS` with ``bench=True``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from server.vllm_hooks import HookTargetMissing, wrap


def wrap_method(module: str, cls: str, method: str, make: Callable[[Any], Any], stream: bool) -> str:
    """Replace ``module.cls.method`` (defined on that class itself) by ``make(original)``, once per process.

    Arguments:
        stream: the method must be an async generator function (else a coroutine function).

    Returns:
        ``module.cls.method``.
    Raises:
        HookTargetMissing: the class or method is not there, or not the kind of function expected.
    """
    where = f"{module}.{cls}.{method}"
    try:
        owner = getattr(importlib.import_module(module), cls)
        original = owner.__dict__[method]
    except (ImportError, AttributeError, KeyError) as exc:
        raise HookTargetMissing(f"{where} not found") from exc
    if not (inspect.isasyncgenfunction if stream else inspect.iscoroutinefunction)(original):
        raise HookTargetMissing(f"{where} is not the kind of function expected")
    wrap(owner, method, make, where)
    return where
