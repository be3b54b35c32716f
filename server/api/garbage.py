"""A full garbage collection after every so many bytes of finished request bodies (API process).

A request's parsed body outlives the request. vLLM's request models declare message content as
``Iterable[...]``; pydantic fills such a field with a ``ValidatorIterator`` that holds the model's own
fields, a reference cycle (made collectable by pydantic-core#1271, not removed) that keeps the whole parsed
body, base64 images included, until the collector's oldest generation is collected. A request's objects
have outlived the young generations by the time it ends, and CPython starts a full collection by counts
of objects, not bytes: measured in-process (0.20 lane), three rounds of three requests, each a refused
17 MiB image, left 143, 239 and 286 MiB behind, freed only by a full collection (stock vLLM the same).
The body budget (``--guard-max-body-memory-mb``) counts a body until its request ends; so that it also
bounds what finished bodies leave behind, the input guard hands each body's bytes to
:class:`FinishedBodies` as it releases them, which runs a full collection once they reach a quarter of
the budget (~1.3 ms in-process: vLLM freezes its start-up heap, so a collection walks only what came
after).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

from server.metrics import definitions as m

logger = logging.getLogger(__name__)

#: The share of the body budget that finished bodies may leave behind before a full collection.
SHARE_OF_BUDGET = 0.25


class FinishedBodies:
    """Counts the bytes of finished request bodies; a full collection each time they reach ``bound``.

    Arguments:
        bound: bytes of finished bodies between two collections (> 0).
        collect: the collection to run (``gc.collect``; tests pass a spy).
    """

    def __init__(self, bound: int, collect: Callable[[], int] = gc.collect) -> None:
        if bound <= 0:
            raise ValueError(f"bound must be positive, not {bound}")
        self.bound = bound
        self.pending = 0  # bytes of bodies finished since the last collection
        self._collect = collect

    @classmethod
    def for_budget(cls, body_budget: int) -> FinishedBodies:
        """For a body budget of ``body_budget`` bytes: a collection after a quarter of it."""
        return cls(max(1, int(body_budget * SHARE_OF_BUDGET)))

    def finished(self, n: int) -> bool:
        """A request released its body of ``n`` bytes. Returns whether a collection ran."""
        self.pending += n
        if self.pending < self.bound:
            return False
        self.pending = 0
        start = time.perf_counter()
        found = self._collect()
        m.BODY_GC_COLLECTIONS.inc()
        logger.debug("finished bodies reached %d bytes: full collection, %d unreachable objects in %.1f ms",
                     self.bound, found, (time.perf_counter() - start) * 1000)  # fmt: skip
        return True
