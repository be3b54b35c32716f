"""vLLM general plugin (entry point ``vllm.general_plugins``: ``vlguard_patches``).

vLLM calls :func:`register` in the API, engine-core and worker processes. It hooks vLLM's model registry
so that every model class vLLM loads is checked for the deepstack defects (:mod:`.detect`) and patched
only where the installed code still has them (:mod:`.deepstack`), and lets vLLM's compile cache load the
CPU platform's inductor artifacts (:mod:`.aot_cache`). ``VLGUARD_PATCHES=off`` disables both.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from server.engine.protocol import PATCHES_ENV
from server.vllm_hooks import models

logger = logging.getLogger("vllm.vlguard.patches")  # runs inside vLLM processes: use its handler

ENV = PATCHES_ENV
KNOWN_PATCHES = ("deepstack_padded_read", "deepstack_empty_buffer")

_registered = False
#: model class qualified name -> patches applied to it, in this process.
_applied: dict[str, list[str]] = {}


def enabled() -> bool:
    """Whether patches are on in this process (``VLGUARD_PATCHES``, default on)."""
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def patch_model_class(cls: Any) -> list[str]:
    """Detect and patch the deepstack defects of one model class. Idempotent.

    Returns:
        The patches active on ``cls`` (empty when it has no deepstack buffer or upstream fixed it).
    """
    from server.patches import deepstack, detect

    name = f"{cls.__module__}.{cls.__qualname__}"
    if name in _applied:
        return _applied[name]
    if not isinstance(cls, type) or not hasattr(cls, deepstack.GET):
        return []
    if not enabled():
        logger.warning("vlguard: patches disabled (%s=off); %s left as installed", ENV, name)
        _applied[name] = []
        _export_patch_metrics()
        return []
    needed = detect.defects(cls)
    if needed:
        methods = deepstack.apply(cls, needed)
        logger.info("vlguard: patched %s (%s): %s", name, ", ".join(needed), ", ".join(methods))
    else:
        logger.info("vlguard: %s needs no deepstack patch", name)
    _applied[name] = needed
    _export_patch_metrics()
    return needed


def active_patches() -> list[str]:
    """Every patch applied in this process, sorted."""
    return sorted({p for patches in _applied.values() for p in patches})


def report() -> dict[str, Any]:
    """What the plugin did in this process: for ``/version`` and the start-up log."""
    import vllm

    return {
        "enabled": enabled(),
        "vllm_version": vllm.__version__,
        "active": active_patches(),
        "classes": dict(_applied),
    }


def _export_patch_metrics() -> None:
    try:
        import vllm

        from server.metrics.definitions import PATCH_ACTIVE

        active = set(active_patches())
        for patch in KNOWN_PATCHES:
            PATCH_ACTIVE.labels(patch=patch, vllm_version=vllm.__version__).set(1 if patch in active else 0)
    except Exception:
        logger.debug("patch metrics unavailable", exc_info=True)


def _check_model_class(cls: type, model_arch: str) -> None:
    """Check one model class vLLM's registry loaded (never raises into vLLM)."""
    try:
        patch_model_class(cls)
    except Exception:
        logger.exception("vlguard: could not check %s for deepstack defects", model_arch)


def register() -> None:
    """Plugin entry point. Idempotent; never raises into vLLM.

    vLLM may load plugins while ``vlguard serve`` is still parsing its arguments, before the
    ``--guard-patches`` choice reaches ``VLGUARD_PATCHES``; so the choice is read when a model class is
    loaded, not here.
    """
    global _registered
    if _registered:
        return
    _registered = True
    try:
        models.on_model_class_load(_check_model_class)  # every architecture, lazily
    except Exception:
        logger.exception("vlguard: plugin registration failed; running without patches")
    try:
        from server.patches import aot_cache

        aot_cache.install()
    except Exception:
        logger.exception("vlguard: compile-cache load backport not installed; vLLM's own loading applies")
