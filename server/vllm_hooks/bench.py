"""Bench-only hooks (API process): the phase trace's stamps on vLLM's request path
(:mod:`server.workload.phase_trace`, loaded only when ``VLGUARD_PHASE_TRACE`` names a file). Serving never
calls this module; its vLLM targets are listed in :data:`server.vllm_hooks.TARGETS` with ``bench=True``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from server.vllm_hooks import MARK, HookTargetMissing, wrap


def wrap_method(module: str, cls: str | None, method: str, make: Callable[[Any], Any], stream: bool | None) -> str:
    """Replace ``module.cls.method`` (defined on that class itself; ``module.method`` when ``cls`` is None)
    by ``make(original)``, once per process.

    Arguments:
        stream: the method must be an async generator function (True), a coroutine function (False) or a
            plain function (None).

    Returns:
        ``module.cls.method``.
    Raises:
        HookTargetMissing: the class or method is not there, or not the kind of function expected.
    """
    where = f"{module}.{cls}.{method}" if cls is not None else f"{module}.{method}"
    try:
        loaded = importlib.import_module(module)
        owner = getattr(loaded, cls) if cls is not None else loaded
        original = owner.__dict__[method]
    except (ImportError, AttributeError, KeyError) as exc:
        raise HookTargetMissing(f"{where} not found") from exc
    if getattr(original, MARK, False):  # wrapped here already (``wrap`` installs nothing twice): the original's kind
        original = original.__wrapped__
    if not _KINDS[stream](original):
        raise HookTargetMissing(f"{where} is not the kind of function expected")
    wrap(owner, method, make, where)
    return where


def _plain(function: Any) -> bool:
    return inspect.isfunction(function) and not (
        inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)
    )


_KINDS: dict[bool | None, Callable[[Any], bool]] = {
    True: inspect.isasyncgenfunction,
    False: inspect.iscoroutinefunction,
    None: _plain,
}
