"""Where the vLLM internals vlguard uses live, across the supported vLLM versions (0.20.0 to 0.34.x).

vlguard imports a handful of names from vLLM's OpenAI front end that moved between versions. They are
resolved here, newest location first, and nowhere else:

- ``make_arg_parser``, ``validate_parsed_serve_args``: ``vllm.entrypoints.openai.cli_args`` (0.20 - 0.22),
  ``vllm.entrypoints.launchers.cli_args`` (0.32), ``vllm.entrypoints.common.cli_args`` (0.34);
- ``ErrorInfo``, ``ErrorResponse``: ``vllm.entrypoints.openai.engine.protocol`` (0.20 - 0.22),
  ``vllm.entrypoints.serve.engine.protocol`` (0.32 - 0.34);
- ``create_error_response``: ``vllm.entrypoints.utils`` (0.20 - 0.22),
  ``vllm.entrypoints.serve.exception_handling.error_response`` (0.32 - 0.34);
- ``AuthenticationMiddleware``: ``vllm.entrypoints.openai.server_utils`` (0.20 - 0.22),
  ``vllm.entrypoints.serve.middleware.authenticate`` (0.32 - 0.34);
- ``init_app_state``: ``vllm.entrypoints.openai.api_server`` (0.20 - 0.22; 0.32 - 0.34 keep a deprecated
  re-export), ``vllm.entrypoints.launchers.api_server.app_state`` (0.32 - 0.34);
- ``build_app``: ``vllm.entrypoints.openai.api_server`` (0.20 - 0.22), ``vllm.entrypoints.launchers.app`` (0.32 -);
- vLLM's launcher helpers ``validate_api_server_args``, ``get_uvicorn_log_config``, ``SSLCertRefresher``:
  ``vllm.entrypoints.openai.api_server``, ``.openai.server_utils``, ``vllm.entrypoints.ssl`` (0.20 - 0.22),
  ``vllm.entrypoints.launchers.launcher``, ``.launchers.utils.server_utils``, ``.launchers.utils.ssl`` (0.32),
  the first moved to ``vllm.entrypoints.common.cli_args`` in 0.34.

vLLM's choice of multimodal processor cache type is the method
``vllm.multimodal.registry.MultiModalRegistry._get_cache_type(self, vllm_config)`` in 0.20 - 0.22 and the
module function ``vllm.multimodal.cache.factories._get_cache_type(vllm_config)`` in 0.32 - 0.34
(:func:`wrap_mm_cache_type`). The API-side processor cache is built by
``MultiModalRegistry.processor_cache_from_config(self, vllm_config)`` in 0.20 - 0.22 and by the module
function the renderer imports, ``vllm.renderers.base.processor_cache_from_config(vllm_config)``, in 0.32
to 0.34 (:func:`wrap_mm_processor_cache_factory`; 0.34 defines it in ``vllm.multimodal.cache.factories``,
the renderer's own name is the one wrapped); vLLM's split cache's API half is
``vllm.multimodal.cache.MultiModalProcessorSenderCache`` in 0.20 - 0.22 and
``vllm.multimodal.cache.LruKeyReplicatedSenderCache`` in 0.32 - 0.34 (:func:`lru_sender_cache`).

``Scheduler.finish_requests`` returns ``(id, client index)`` pairs up to 0.22 and ``Request`` objects in
0.32 (:func:`finished_requests`). Differences in behaviour rather than location are handled where they
happen, without version checks:
the deepstack backports probe each model class for the defects themselves (:mod:`server.patches.detect`);
the aligned scheduler asks vLLM for an empty encoder schedule instead of building one (its shape changed
from 4 to 5 values in 0.32); the test-only padding emulation passes vLLM's keyword arguments through.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from server.vllm_hooks import wrap as hook

#: name -> modules that may define it, newest vLLM first.
MOVED: dict[str, tuple[str, ...]] = {
    "make_arg_parser": (
        "vllm.entrypoints.common.cli_args",
        "vllm.entrypoints.launchers.cli_args",
        "vllm.entrypoints.openai.cli_args",
    ),
    "validate_parsed_serve_args": (
        "vllm.entrypoints.common.cli_args",
        "vllm.entrypoints.launchers.cli_args",
        "vllm.entrypoints.openai.cli_args",
    ),
    "ErrorInfo": ("vllm.entrypoints.serve.engine.protocol", "vllm.entrypoints.openai.engine.protocol"),
    "ErrorResponse": ("vllm.entrypoints.serve.engine.protocol", "vllm.entrypoints.openai.engine.protocol"),
    "create_error_response": (
        "vllm.entrypoints.serve.exception_handling.error_response",
        "vllm.entrypoints.utils",
    ),
    "AuthenticationMiddleware": (
        "vllm.entrypoints.serve.middleware.authenticate",
        "vllm.entrypoints.openai.server_utils",
    ),
    "init_app_state": ("vllm.entrypoints.launchers.api_server.app_state", "vllm.entrypoints.openai.api_server"),
    "build_app": ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"),
    "validate_api_server_args": (
        "vllm.entrypoints.common.cli_args",
        "vllm.entrypoints.launchers.launcher",
        "vllm.entrypoints.openai.api_server",
    ),
    "get_uvicorn_log_config": ("vllm.entrypoints.launchers.utils.server_utils", "vllm.entrypoints.openai.server_utils"),
    "SSLCertRefresher": ("vllm.entrypoints.launchers.utils.ssl", "vllm.entrypoints.ssl"),
}


def _missing(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether ``exc`` says ``module`` itself (or a parent package) is absent, not one of its imports."""
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


def _import_if_present(module: str) -> ModuleType | None:
    """``module`` imported, or None when the installed vLLM has no such module. Raises what importing it
    raises otherwise (a missing dependency of a module that exists is an error, not an absence)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if _missing(exc, module):
            return None
        raise


def source_of(name: str) -> str:
    """The module the installed vLLM defines ``name`` in.

    Raises:
        KeyError: ``name`` is not one of :data:`MOVED`.
        ImportError: no known location defines it (an unsupported vLLM version).
    """
    for module in MOVED[name]:
        mod = _import_if_present(module)
        if mod is not None and hasattr(mod, name):
            return module
    raise ImportError(f"vLLM defines {name} in none of {', '.join(MOVED[name])}: unsupported vLLM version")


def vllm_symbol(name: str) -> Any:
    """The installed vLLM's ``name`` (a class or function of :data:`MOVED`). Raises as :func:`source_of`."""
    return getattr(importlib.import_module(source_of(name)), name)


#: Where vLLM chooses its multimodal processor cache type, newest vLLM first: (module, class or None).
CACHE_TYPE_CHOOSERS: tuple[tuple[str, str | None], ...] = (
    ("vllm.multimodal.cache.factories", None),
    ("vllm.multimodal.registry", "MultiModalRegistry"),
)


def _wrap_first(locations: tuple[tuple[str, str | None], ...], name: str, wrap: Callable[..., Any]) -> str | None:
    """Replace ``name`` at the first of ``locations`` (module, class or None) that defines it by
    ``wrap(original)``; returns the qualified name replaced, None where no location defines it."""
    for module, owner in locations:
        if (mod := _import_if_present(module)) is None:
            continue
        target: Any = getattr(mod, owner, None) if owner else mod
        if target is not None and hasattr(target, name):
            where = ".".join(filter(None, (module, owner, name)))
            hook(target, name, wrap, where)
            return where
    return None


def wrap_mm_cache_type(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> str:
    """Replace vLLM's ``_get_cache_type`` (the processor cache type chooser) by ``wrap(original)``.
    ``wrap`` must accept both signatures (``(vllm_config)`` and ``(self, vllm_config)``).

    Returns:
        The qualified name that was replaced.
    Raises:
        ImportError: no known location defines the chooser (an unsupported vLLM version).
    """
    if (where := _wrap_first(CACHE_TYPE_CHOOSERS, "_get_cache_type", wrap)) is None:
        raise ImportError("vLLM's multimodal cache type chooser was not found: unsupported vLLM version")
    return where


#: Where vLLM's renderer builds its API-side processor cache, newest vLLM first: (module, class or None).
PROCESSOR_CACHE_FACTORIES: tuple[tuple[str, str | None], ...] = (
    ("vllm.renderers.base", None),
    ("vllm.multimodal.registry", "MultiModalRegistry"),
)
#: vLLM's API half of the split (``lru``) processor cache, newest name first.
LRU_SENDER_CACHES = ("LruKeyReplicatedSenderCache", "MultiModalProcessorSenderCache")


def wrap_mm_processor_cache_factory(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> str:
    """Replace the ``processor_cache_from_config`` vLLM's renderer calls by ``wrap(original)``. ``wrap``
    must accept both signatures (``(vllm_config)`` and ``(self, vllm_config)``).

    Returns:
        The qualified name that was replaced.
    Raises:
        ImportError: no known location defines it (an unsupported vLLM version).
    """
    if (where := _wrap_first(PROCESSOR_CACHE_FACTORIES, "processor_cache_from_config", wrap)) is None:
        raise ImportError("vLLM's multimodal processor cache factory was not found: unsupported vLLM version")
    return where


#: Where vLLM's multimodal item trackers (which collect a prompt's media items and their uuids) live,
#: newest vLLM first.
ITEM_TRACKER_MODULES = (
    "vllm.renderers.chat_utils.item_tracker",
    "vllm.renderers.chat_utils",
    "vllm.entrypoints.chat_utils",
)
ITEM_TRACKERS = ("MultiModalItemTracker", "AsyncMultiModalItemTracker")


def wrap_item_trackers(name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> list[str]:
    """Replace method ``name`` of both of vLLM's multimodal item trackers (sync and async) by
    ``wrap(original)``.

    Returns:
        The qualified names replaced.
    Raises:
        ImportError: no known location defines them (an unsupported vLLM version).
    """
    for module in ITEM_TRACKER_MODULES:
        if (mod := _import_if_present(module)) is not None and all(hasattr(mod, cls) for cls in ITEM_TRACKERS):
            for cls in ITEM_TRACKERS:
                hook(getattr(mod, cls), name, wrap, f"{module}.{cls}.{name}")
            return [f"{module}.{cls}.{name}" for cls in ITEM_TRACKERS]
    raise ImportError("vLLM's multimodal item trackers were not found: unsupported vLLM version")


def lru_sender_cache(model_config: Any) -> Any:
    """A new API half of vLLM's split ``lru`` processor cache for ``model_config`` (sized by its
    ``mm_processor_cache_gb``): it records the items sent and answers which ones the engine core's
    receiver cache holds, evicting in the receiver's order.

    Raises:
        ImportError: an unsupported vLLM version.
    """
    import vllm.multimodal.cache as cache

    for name in LRU_SENDER_CACHES:
        if (cls := getattr(cache, name, None)) is not None:
            return cls(model_config)
    raise ImportError("vLLM's lru sender cache was not found: unsupported vLLM version")


def processor_only_cache(model_config: Any) -> Any:
    """A new ``processor_only`` processor cache (vLLM's API-side cache that keeps the processed items)."""
    from vllm.multimodal.cache import MultiModalProcessorOnlyCache

    return MultiModalProcessorOnlyCache(model_config)


def build_renderer_and_input_processor(vllm_config: Any) -> tuple[Any, Any]:
    """The API-side objects ``AsyncLLM`` builds for ``vllm_config``: the renderer (tokenizer, chat
    template, multimodal processor) and the input processor. Used to serve vLLM's real front end over
    an engine other than ``AsyncLLM`` (the tests' fake engine core).

    Raises:
        ImportError: an unsupported vLLM version.
    """
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    renderer = renderer_from_config(vllm_config)
    return renderer, InputProcessor(vllm_config, renderer)


def upstream_image_rules() -> frozenset[str]:
    """The rules of :mod:`server.api.pixels` that the installed vLLM's image loader applies itself, so
    vlguard need not: ``orientation`` (``vllm.multimodal.image.normalize_image``, EXIF transpose)
    and ``transparency`` (``_has_transparency``: LA, PA, tRNS composited on the background), both in
    vLLM 0.32.0; none in 0.20.0 and 0.22.1. Only what vLLM lacks is backported."""
    import vllm.multimodal.image as image

    found = {"orientation"} if hasattr(image, "normalize_image") else set()
    if hasattr(image, "_has_transparency"):
        found.add("transparency")
    return frozenset(found)


def finished_requests(result: Any) -> list[tuple[str, int]]:
    """``(request id, client index)`` of what vLLM's ``Scheduler.finish_requests`` returned: such pairs
    (0.20.0, 0.22.1) or the ``Request`` objects (0.32.0)."""
    return [item if isinstance(item, tuple) else (item.request_id, item.client_index) for item in result]


def upstream_decode_budget() -> bool:
    """Whether the installed vLLM charges each request's decoded media bytes to a budget of the request's
    own (``ImageMediaIO(decoded_budget=...)``, ``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES``: vLLM 0.34.0; not in
    0.20.0-0.32.0). An image served from vlguard's decoded-image cache would skip that charge."""
    import inspect

    from vllm.multimodal.media import ImageMediaIO

    return "decoded_budget" in inspect.signature(ImageMediaIO).parameters
