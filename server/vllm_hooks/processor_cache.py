"""vLLM's multimodal processor cache in the form replays survive (vLLM plugin ``vlguard_replay_cache``).

vLLM's default processor cache (``lru``) is split across processes: the API process remembers which
images it has sent and sends a repeat *without* its data; the engine core's receiver cache keeps the
data. A replay or resume re-submits such an input to an engine core that may never have seen it (a
rebuilt one): vLLM fails it with "Expected a cached item for mm_hash" (the same class as upstream
vllm#31404; vLLM 0.32.0 finishes the request with an error and tells its API side which hashes were
missing).

vlguard keeps both halves but moves the stripping to where the guard can undo it:

* **API process** (installed by ``vlguard serve``): vLLM's renderer gets a ``processor_only`` cache
  where vLLM would build the API half of ``lru``: a repeated image skips Hugging Face preprocessing as on
  stock vLLM, and the rendered prompt always carries the processed data. The guard's engine client then
  strips, per engine core, what that engine core already holds (:mod:`server.guard.ipc_cache`): a
  repeat crosses the socket as a hash, as on stock, while a replay to a new engine core is sent whole.
* **Every vLLM process** (the API process at install, engine processes through this plugin when
  ``VLGUARD_REPLAY_CACHE=1``, or by inheritance when forked): ``shm`` (whose data the API process would
  write to shared memory) becomes ``lru``; the engine core keeps ``lru``'s receiver cache.

``--mm-processor-cache-gb`` sizes both halves and 0 turns them off. Memory: the API process holds the
processed items of its cache (stock: their sizes only), so host memory for the cache is up to twice
``--mm-processor-cache-gb``. A stock ``vllm serve`` in the same environment keeps vLLM's behaviour.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from server.engine.protocol import REPLAY_CACHE_ENV

ENV = REPLAY_CACHE_ENV
logger = logging.getLogger("vllm.vlguard.replay_cache")
_chooser_at: str | None = None  # where the chooser was wrapped (engine_receiver), in this process
_factory_at: str | None = None  # where the API-side factory was wrapped (replay_safe), in this process
#: set when this (API) process's renderer was given ``processor_only`` where vLLM built its lru sender.
_replaced = False


def engine_receiver(choose: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's cache-type chooser (either signature) so that ``shm`` becomes ``lru``: the engine core
    keeps a receiver cache the guard's engine client strips against; nothing goes through shared memory.
    Installed in every vLLM process of ``vlguard serve`` (an engine core forked from the API process
    inherits it; a spawned one installs it through the plugin)."""

    def choose_receiver(*args: Any, **kwargs: Any) -> Any:
        chosen = choose(*args, **kwargs)
        return "lru" if chosen == "shm" else chosen

    choose_receiver.__wrapped__ = choose  # type: ignore[attr-defined]
    return choose_receiver


def replay_safe(build: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's API-side processor cache factory (either signature) so that where it builds the API
    half of the split cache it builds ``processor_only`` instead (same size; the engine core's receiver
    is untouched): the rendered prompt then always carries the processed items."""
    from server.vllm_hooks.locations import LRU_SENDER_CACHES, processor_only_cache

    def build_replay_safe(*args: Any, **kwargs: Any) -> Any:
        global _replaced
        cache = build(*args, **kwargs)
        if type(cache).__name__ not in LRU_SENDER_CACHES:
            return cache
        vllm_config: Any = kwargs["vllm_config"] if "vllm_config" in kwargs else args[-1]
        _replaced = True
        return processor_only_cache(vllm_config.model_config)

    build_replay_safe.__wrapped__ = build  # type: ignore[attr-defined]
    return build_replay_safe


def engine_keeps_cache() -> bool:
    """Whether this (API) process's renderer was given ``processor_only`` in place of vLLM's split cache:
    the engine cores then hold a receiver cache the engine client strips against
    (:mod:`server.guard.ipc_cache`)."""
    return _replaced


def install() -> str:
    """API form: the chooser's engine form (:func:`engine_receiver`) and the factory's replay-safe form
    (:func:`replay_safe`) in this process. Idempotent.

    Returns:
        Where vLLM was wrapped (see :mod:`server.vllm_hooks.locations`).
    Raises:
        ImportError: the installed vLLM has no known cache-type chooser or processor cache factory.
    """
    global _chooser_at, _factory_at
    from server.vllm_hooks.locations import wrap_mm_cache_type, wrap_mm_processor_cache_factory

    if _factory_at is None:  # also when the plugin already wrapped the chooser (the variable was inherited)
        _factory_at = wrap_mm_processor_cache_factory(replay_safe)
    if _chooser_at is None:
        _chooser_at = wrap_mm_cache_type(engine_receiver)
    return f"{_chooser_at}, {_factory_at}"


def plugin_installed() -> bool:
    """Whether vLLM will find this plugin in its engine processes (vlguard's package metadata lists the
    entry point; an install older than the code would not, and a spawned engine core would then run
    ``shm``'s shared-memory reader for data the API process never wrote)."""
    from importlib.metadata import entry_points

    return any(ep.value == f"{__name__}:register" for ep in entry_points(group="vllm.general_plugins"))


def register() -> None:
    """Plugin entry point: the chooser's engine form when ``VLGUARD_REPLAY_CACHE=1``, unless already
    wrapped in this process (by :func:`install`, which also wraps the API-side factory). Never raises."""
    global _chooser_at
    if os.environ.get(ENV) != "1" or _chooser_at is not None:
        return
    try:
        from server.vllm_hooks.locations import wrap_mm_cache_type

        _chooser_at = wrap_mm_cache_type(engine_receiver)
        logger.info("vlguard: engine-side multimodal receiver cache in this process (%s wrapped)", _chooser_at)
    except Exception:
        logger.exception("vlguard: engine form of the processor cache not installed in this process")
