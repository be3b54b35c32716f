"""Poison-request quarantine: a request in flight at K engine deaths is never replayed again.

Innocent requests that merely shared a batch with a poison request must not be quarantined with it, so
a request with a strike runs on probation: one such request at a time (the engine client serialises
them), and the next death is charged to it alone among the suspects.

Requests are identified by a fingerprint of what the engine would compute (prompt token ids, image
hashes, sampling parameters), never by their text: logs and errors carry the fingerprint only.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any


class QuarantinedRequestError(ValueError):
    """The request was in flight at too many engine deaths and is refused. HTTP 400."""


def fingerprint(prompt: Any, sampling_params: Any) -> str:
    """A short, stable id of a request's engine-side content.

    Arguments:
        prompt: what vLLM's serving layer hands ``generate()``: a dict with ``prompt_token_ids`` and, for
            images, ``mm_hashes``; or a plain string.
        sampling_params: ``vllm.SamplingParams`` (its ``repr`` lists every field).

    Returns:
        16 hex characters.
    """
    h = hashlib.sha256()
    if isinstance(prompt, dict):
        h.update(repr(prompt.get("prompt_token_ids")).encode())
        h.update(repr(prompt.get("mm_hashes")).encode())
        h.update(repr(prompt.get("prompt")).encode() if "prompt_token_ids" not in prompt else b"")
    else:
        h.update(repr(prompt).encode())
    h.update(repr(sampling_params).encode())
    return h.hexdigest()[:16]


class Quarantine:
    """Counts engine deaths per fingerprint; bounded in size (LRU) and time (TTL).

    Arguments:
        deaths: deaths a fingerprint must have been in flight for to be quarantined (K >= 1).
        max_entries: fingerprints remembered at most; the least recently seen are forgotten first.
        ttl_s: seconds after its last death that a fingerprint is forgotten.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(
        self, deaths: int, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.deaths = deaths
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._seen: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def _expire(self) -> None:
        now = self._clock()
        for fp in [fp for fp, (_, at) in self._seen.items() if now - at > self.ttl_s]:
            del self._seen[fp]

    def record_death(self, fingerprints: Iterable[str]) -> list[str]:
        """Count one death for each fingerprint in flight. Returns those that became quarantined."""
        self._expire()
        now, newly = self._clock(), []
        for fp in set(fingerprints):
            count = self._seen.pop(fp, (0, now))[0] + 1
            self._seen[fp] = (count, now)
            if count == self.deaths:
                newly.append(fp)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return sorted(newly)

    def strikes(self, fp: str) -> int:
        """Engine deaths ``fp`` was in flight for (within the TTL)."""
        self._expire()
        entry = self._seen.get(fp)
        return entry[0] if entry is not None else 0

    def is_quarantined(self, fp: str) -> bool:
        self._expire()
        entry = self._seen.get(fp)
        return entry is not None and entry[0] >= self.deaths

    def check(self, fp: str) -> None:
        """Raises:
        QuarantinedRequestError: ``fp`` is quarantined."""
        if self.is_quarantined(fp):
            raise QuarantinedRequestError(
                f"Request refused: an identical request was in flight at {self.deaths} engine deaths and is "
                f"quarantined (fingerprint {fp}). Change the request or contact the operator."
            )
