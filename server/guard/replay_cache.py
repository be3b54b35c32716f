"""vLLM's multimodal processor cache in the form replays survive (vLLM plugin ``vlguard_replay_cache``).

vLLM's default processor cache (``lru``; ``shm`` likewise) is split across processes: the API process
remembers which images it has sent and sends a repeat *without* its data; the engine core keeps the data.
A replay or resume re-submits such an input to an engine core that may never have seen it (a rebuilt one,
or one whose caches a soft recovery reset): vLLM fails it with "Expected a cached item for mm_hash" (the
same class as upstream vllm#31404). vLLM's ``processor_only`` cache, which vLLM itself uses when IPC
caching is unavailable (several API processes), keeps the processed items in the API process and always
sends them whole, so any engine core can run any replay. This module makes vLLM choose ``processor_only``
wherever it would choose ``lru`` or ``shm``; ``--mm-processor-cache-gb`` still sizes it and 0 still turns
it off. A repeated image (the rescue pass of the two-pass workload) then skips Hugging Face
preprocessing, as on stock vLLM; what it costs instead is sending the processed image to the engine core
again (a copy over vLLM's ZMQ socket; no engine-side copy is kept).

``vlguard serve`` installs it in its own (API) process, where the cache lives, and sets
``VLGUARD_REPLAY_CACHE=1`` so that the plugin installs it in the engine processes too (they then build no
receiver cache); a stock ``vllm serve`` in the same environment keeps vLLM's behaviour.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

ENV = "VLGUARD_REPLAY_CACHE"
#: cache types whose engine side holds the data; replaced by the API-side-only "processor_only".
SPLIT_CACHES = ("lru", "shm")

logger = logging.getLogger("vllm.vlguard.replay_cache")
_installed_at: str | None = None


def replay_safe(choose: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's cache-type chooser (either signature) so that split cache types become ``processor_only``."""

    def choose_replay_safe(*args: Any, **kwargs: Any) -> Any:
        chosen = choose(*args, **kwargs)
        return "processor_only" if chosen in SPLIT_CACHES else chosen

    choose_replay_safe.__wrapped__ = choose  # type: ignore[attr-defined]
    return choose_replay_safe


def install() -> str:
    """Make this process's vLLM choose a replay-safe processor cache. Idempotent.

    Returns:
        Where vLLM's chooser was wrapped (see :func:`server.compat.wrap_mm_cache_type`).
    Raises:
        ImportError: the installed vLLM has no known cache-type chooser.
    """
    global _installed_at
    if _installed_at is None:
        from server.compat import wrap_mm_cache_type

        _installed_at = wrap_mm_cache_type(replay_safe)
    return _installed_at


def plugin_installed() -> bool:
    """Whether vLLM will find this plugin in its engine processes (vlguard's package metadata lists the
    entry point; an install older than the code would not, and its engine core would then build vLLM's
    engine-side cache besides)."""
    from importlib.metadata import entry_points

    return any(ep.value == f"{__name__}:register" for ep in entry_points(group="vllm.general_plugins"))


def register() -> None:
    """Plugin entry point: :func:`install` when ``VLGUARD_REPLAY_CACHE=1``. Never raises into vLLM."""
    if os.environ.get(ENV) != "1":
        return
    try:
        if _installed_at is None:  # vlguard serve installs (and logs) it in its own process first
            logger.info("vlguard: replay-safe multimodal processor cache in this process (%s wrapped)", install())
    except Exception:
        logger.exception("vlguard: replay-safe processor cache not installed in this process")
