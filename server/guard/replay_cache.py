"""Keep vLLM's multimodal processor cache on in a form that replays survive (vLLM plugin).

Entry point ``vllm.general_plugins``: ``vlguard_replay_cache``; ``vlguard serve`` also installs it in its
own (API) process directly, since that is where correctness depends on it. It acts only where
``VLGUARD_REPLAY_CACHE=1`` (set by ``vlguard serve``), so a stock ``vllm serve`` in the same environment
keeps vLLM's behaviour.

vLLM's default processor cache (``lru``) is split across processes: the API process remembers which
images it has sent and sends a repeat *without* its data; the engine core keeps the data. A replay after
an engine death re-submits such inputs to a fresh engine core that never saw them (vLLM: "Expected a
cached item for mm_hash"). vLLM's ``processor_only`` cache, which vLLM itself uses when IPC caching is
unavailable (several API processes), keeps the processed items in the API process and always sends them
whole, so any engine core can run any replay. This plugin makes vLLM choose ``processor_only`` wherever it
would choose ``lru`` or ``shm``; ``--mm-processor-cache-gb`` still sizes it and 0 still turns it off. The
two-pass workload's rescue pass then skips Hugging Face image preprocessing, as on stock vLLM.
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


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _installed_at is not None


def register() -> None:
    """Plugin entry point: :func:`install` when ``VLGUARD_REPLAY_CACHE=1``. Never raises into vLLM."""
    if os.environ.get(ENV) != "1":
        return
    try:
        install()
    except Exception:
        logger.exception("vlguard: replay-safe processor cache not installed in this process")
