"""Hooks on vLLM's model classes (every vLLM process: API, engine core, workers).

- :func:`on_model_class_load`: call back with each model class vLLM's registry loads
  (``vllm.model_executor.models.registry._ModelRegistry._try_load_model_cls``, private; every
  architecture, lazily);
- :func:`replace_methods` / :func:`restore_methods`: methods of a model class replaced in place and put
  back (the deepstack backports, :mod:`server.patches.deepstack`, which probe each class for the defects
  first: :mod:`server.patches.detect`);
- :func:`wrap_compiled_function_load`: torch's ``torch.compiler.load_compiled_function``, which vLLM's
  compile cache calls (:mod:`server.patches.aot_cache`).

Targets in :data:`server.vllm_hooks.TARGETS`; checked on vLLM 0.20.0, 0.22.1, 0.32.0 and 0.34.0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from server.vllm_hooks import wrap

#: Where :func:`replace_methods` keeps a class's own methods it replaced (for :func:`restore_methods`).
ORIGINALS = "__vlguard_originals__"


def on_model_class_load(callback: Callable[[type, str], None]) -> None:
    """Call ``callback(cls, architecture)`` with each model class vLLM's registry loads (once per process;
    an exception in ``callback`` is the caller's to contain: wrap it).

    Raises:
        HookTargetMissing: the registry's loader is not there (an unsupported vLLM version).
    """
    from vllm.model_executor.models import registry

    def checked(original: Callable[..., Any]) -> Callable[..., Any]:
        def _try_load_model_cls(self: Any, model_arch: str) -> Any:
            cls = original(self, model_arch)
            if cls is not None:
                callback(cls, model_arch)
            return cls

        return _try_load_model_cls

    target = "vllm.model_executor.models.registry._ModelRegistry._try_load_model_cls"
    wrap(registry._ModelRegistry, "_try_load_model_cls", checked, target)


def replace_methods(cls: type, replacements: Mapping[str, Callable[..., Any]]) -> None:
    """Set each ``name -> function`` of ``replacements`` on ``cls`` (a vLLM model class), keeping the
    class's own definition of each, once, for :func:`restore_methods`. Idempotent."""
    originals = cls.__dict__.get(ORIGINALS, {})
    for name, fn in replacements.items():
        if name not in originals and name in cls.__dict__:
            originals[name] = cls.__dict__[name]
        setattr(cls, name, fn)
    setattr(cls, ORIGINALS, originals)


def restore_methods(cls: type) -> list[str]:
    """Put back the methods :func:`replace_methods` replaced on ``cls``.

    Returns:
        The names restored (sorted; empty when ``cls`` was not patched).
    """
    originals: dict[str, Any] = cls.__dict__.get(ORIGINALS, {})
    for name, fn in originals.items():
        setattr(cls, name, fn)
    if ORIGINALS in cls.__dict__:
        delattr(cls, ORIGINALS)
    return sorted(originals)


def wrap_compiled_function_load(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``torch.compiler.load_compiled_function`` by ``make(original)``, once per process.

    Returns:
        Whether it is in place (False: this torch has no AOT load function).
    """
    import torch.compiler

    if getattr(torch.compiler, "load_compiled_function", None) is None:
        return False
    wrap(torch.compiler, "load_compiled_function", make, "torch.compiler.load_compiled_function")
    return True
