"""Which processed images an engine core already holds: the guard strips those from what it sends (#16).

vLLM's split processor cache strips a repeated image from the request when it is *rendered*, trusting
that the engine core that will run it holds the data. The guard may send a request to another engine
core (a replay after a rebuild), and its own waits (hold, probation) can reorder requests between
rendering and sending. So vlguard renders with vLLM's
``processor_only`` cache (the rendered prompt always carries the data; :mod:`server.vllm_hooks.processor_cache`)
and strips here, as the request is sent to one engine core, against a shadow of *that* engine core's
receiver cache: vLLM's own API half of the split cache (``lru`` sender), one per engine core (a soft
recovery keeps the engine core's cache, and with it the shadow).

A shadow can still drift from the receiver (requests that reach the engine core in another order than
they were stripped, a reset through vLLM's own ``reset_mm_cache``): the engine core then finishes the
request with ``ERROR`` and no token (vLLM's handling of an error while adding a request; 0.32.0 names the
missing hashes), and the engine client sends it again whole, once (:func:`cache_miss`,
:mod:`server.guard.engine_client`). Any other error a stripped request meets while being added is sent
again once the same way, then passed on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)


class EngineCacheShadow:
    """The receiver cache of one engine core, as seen from the API process.

    Arguments:
        sender: vLLM's API half of the split cache (:func:`server.vllm_hooks.locations.lru_sender_cache`), sized as the
            engine core's receiver (``--mm-processor-cache-gb``).
    """

    def __init__(self, sender: Any) -> None:
        self._sender = sender

    def strip(self, prompt: Any) -> tuple[Any, bool]:
        """``prompt`` as it should cross the socket to this engine core: each processed item the engine
        core holds replaced by ``None`` (vLLM's marker for "use your cached copy"), the others recorded as
        now held. ``prompt`` itself is not changed.

        Arguments:
            prompt: a processed engine input (a dict with ``mm_kwargs``, modality -> list of processed
                items, and ``mm_hashes``, modality -> list of hashes); anything else passes unchanged.
        Returns:
            The prompt to send, and whether any item was stripped from it. A prompt of a shape this does
            not know is sent as it is (logged).
        """
        try:
            return self._strip(prompt)
        except Exception:  # never fail a request over an optimisation: the whole prompt is always valid
            logger.exception("processed images sent whole: unexpected engine input")
            return prompt, False

    def _strip(self, prompt: Any) -> tuple[Any, bool]:
        if not isinstance(prompt, dict):
            return prompt, False
        kwargs, hashes = prompt.get("mm_kwargs"), prompt.get("mm_hashes")
        if not isinstance(kwargs, Mapping) or not isinstance(hashes, Mapping) or not kwargs:
            return prompt, False
        # As vLLM's renderer does: touch every hash first, so that none is evicted by another's update.
        for modality_hashes in hashes.values():
            for mm_hash in modality_hashes:
                self._sender.touch_sender_cache_item(mm_hash)
        sent: dict[str, list[Any]] = {}
        stripped = False
        for modality, items in kwargs.items():
            sent[modality] = []
            for item, mm_hash in zip(items, hashes.get(modality, ()), strict=True):
                if item is None:  # rendered without its data (not vlguard's renderer): leave it as it is
                    sent[modality].append(None)
                    continue
                out, _ = self._sender.get_and_update_item((item, []), mm_hash)
                stripped = stripped or out is None
                sent[modality].append(out)
        if not stripped:
            return prompt, False
        container: Any = type(kwargs)  # vLLM's MultiModalKwargsItems (a dict by modality)
        return {**prompt, "mm_kwargs": container(sent)}, True


def shadow_for(engine: Any) -> EngineCacheShadow | None:
    """A shadow for a newly built ``engine`` (an ``AsyncLLM``), or None where its engine core keeps no
    receiver cache (processor cache off, several API processes, or the split cache not replaced here:
    then nothing is stripped and every request is sent as rendered)."""
    from server.vllm_hooks import processor_cache as replay_cache
    from server.vllm_hooks.locations import lru_sender_cache

    config = getattr(engine, "model_config", None)
    if not replay_cache.engine_keeps_cache() or config is None:
        return None
    return EngineCacheShadow(lru_sender_cache(config))


def cache_miss(output: Any, stripped: bool, first: bool) -> bool:
    """Whether ``output`` is an engine core's receiver miss: the first output of a request sent with
    stripped items, finished with ``ERROR`` and without a token."""
    return (
        stripped
        and first
        and bool(output.finished)
        and bool(output.outputs)
        and all(c.finish_reason == "error" and not c.token_ids for c in output.outputs)
    )
