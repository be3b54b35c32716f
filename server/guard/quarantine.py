"""Poison-request quarantine: a request in the failing step of K engine faults is never replayed again.

A fault gives a strike only to the requests of the step whose execution raised (the supervisor decides
who, :func:`server.guard.supervisor.charged_requests`); a request with a strike runs on probation,
isolated (:mod:`server.guard.inflight`), so its next fault is its own.

Requests are identified by a fingerprint of what the engine would compute (prompt token ids, image
hashes, the constraint and token-id fields, not volatile sampling values), never by their text: logs and
errors carry the fingerprint only.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from server.guard.errors import QuarantinedRequestError
from server.guard.peers import Change, Peers, Received

__all__ = ["Fingerprint", "Quarantine", "QuarantinedRequestError", "fingerprint"]


#: The ``SamplingParams`` fields a fingerprint holds: what shapes the engine core's work besides the prompt
#: (the structured-output constraint, token-id lists the sampler indexes with). Volatile sampling values
#: (seed, temperature, top-p/k, penalties, max_tokens, n, logprobs) are left out: the same poison with a
#: new seed is the same request to the quarantine (#34), and what varies beyond that is the per-client
#: fault budget's to stop (:mod:`server.guard.clients`).
CONTENT_FIELDS = ("structured_outputs", "stop_token_ids", "allowed_token_ids", "logit_bias", "bad_words")


def _token_bytes(ids: Any) -> bytes:
    """Token ids as bytes: a list of ints packed at C speed (its ``repr`` took ~0.1 ms for 1,500 tokens);
    anything else by its ``repr``, which an int list's packing never equals (different length or bytes)."""
    if isinstance(ids, list):
        with contextlib.suppress(TypeError, OverflowError):
            return b"i64:" + array.array("q", ids).tobytes()
    return repr(ids).encode()


def fingerprint(prompt: Any, sampling_params: Any) -> str:
    """A short, stable id of a request's engine-side content.

    Arguments:
        prompt: what vLLM's serving layer hands ``generate()``: a dict with ``prompt_token_ids`` and, for
            images, ``mm_hashes``; or a plain string.
        sampling_params: ``vllm.SamplingParams``: only its :data:`CONTENT_FIELDS` count.

    Returns:
        16 hex characters.
    """
    return _hashed(prompt, _content_of(sampling_params))


def _content_of(sampling_params: Any) -> bytes:
    """The :data:`CONTENT_FIELDS` of ``sampling_params`` as they are now (~1 us). vLLM changes some of them
    on the object it is handed (it does not copy the serving layer's: ``skip_clone``): structured outputs
    get their backend, ``stop_token_ids`` the generation config's end tokens; so they are read when the
    request enters, as the quarantine check of the next such request reads them."""
    return "".join(f";{name}={getattr(sampling_params, name, None)!r}" for name in CONTENT_FIELDS).encode()


def _hashed(prompt: Any, content: bytes) -> str:
    h = hashlib.sha256()
    if isinstance(prompt, dict):
        h.update(_token_bytes(prompt.get("prompt_token_ids")))
        h.update(repr(prompt.get("mm_hashes")).encode())
        h.update(repr(prompt.get("prompt")).encode() if "prompt_token_ids" not in prompt else b"")
    else:
        h.update(repr(prompt).encode())
    h.update(content)
    return h.hexdigest()[:16]


class Fingerprint:
    """One request's :func:`fingerprint`, its prompt hashed the first time it is read (``value``,
    ``str()``). Most requests never need it: it is read to check a quarantine that remembers any strike,
    for a suspect, when a fault is charged, and in a log line. ~20 us for a 740-token prompt otherwise
    spent on every request. The sampling parameters' part is taken at once (:func:`_content_of`).

    Arguments:
        prompt, sampling_params: as :func:`fingerprint` (the prompt is released once it is hashed).
    """

    __slots__ = ("_content", "_prompt", "_value")
    __hash__ = None  # type: ignore[assignment]  # compare values (``.value``), never these objects

    def __init__(self, prompt: Any, sampling_params: Any) -> None:
        self._prompt, self._content = prompt, _content_of(sampling_params)
        self._value: str | None = None

    @property
    def value(self) -> str:
        if self._value is None:
            self._value = _hashed(self._prompt, self._content)
            self._prompt = None
        return self._value

    def __str__(self) -> str:
        return self.value


class Quarantine:
    """Counts strikes per fingerprint; bounded in size (LRU) and time (TTL).

    Arguments:
        deaths: strikes (faults whose failing step held it) that quarantine a fingerprint (K >= 1).
        max_entries: fingerprints remembered at most; the least recently seen are forgotten first.
        ttl_s: seconds after its last strike that a fingerprint is forgotten.
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
        #: the other API processes of this server, told of each change (:mod:`server.guard.peers`); None: alone
        self.peers: Peers | None = None
        self.received = Received()  # their changes, taken in at the next read

    def _expire(self) -> None:
        if self.received:
            self._take_received()
        now = self._clock()
        for fp in [fp for fp, (_, at) in self._seen.items() if now - at > self.ttl_s]:
            del self._seen[fp]

    def _take_received(self) -> None:
        for change in self.received.take():
            if change.kind == "strikes":
                self._strike((fp for fp in change.values if fp is not None), change.at)
            elif change.kind == "cleared":
                for fp in change.values:
                    self._forget(fp)

    def record_death(self, fingerprints: Iterable[str]) -> list[str]:
        """Count one strike for each fingerprint charged with a fault (peers too). Returns those that became
        quarantined."""
        fingerprints = sorted(set(fingerprints))
        if self.peers is not None and fingerprints:
            self.peers.publish(Change("strikes", tuple(fingerprints), self._clock()))
        self._expire()
        return self._strike(fingerprints)

    def _strike(self, fingerprints: Iterable[str], at: float | None = None) -> list[str]:
        now, newly = self._clock() if at is None else at, []  # at: a peer's strike, taken in late
        for fp in set(fingerprints):
            count, last = self._seen.pop(fp, (0, now))
            self._seen[fp] = (count + 1, max(last, now))
            count += 1
            if count == self.deaths:
                newly.append(fp)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return sorted(newly)

    def empty(self) -> bool:
        """Whether no fingerprint has a strike (expired ones may still count until the next read)."""
        if self.received:
            self._take_received()
        return not self._seen

    def strikes(self, fp: str) -> int:
        """Strikes ``fp`` has (within the TTL)."""
        self._expire()
        entry = self._seen.get(fp)
        return entry[0] if entry is not None else 0

    def is_quarantined(self, fp: str) -> bool:
        """Whether ``fp`` has ``deaths`` strikes within the TTL (it is refused)."""
        self._expire()
        entry = self._seen.get(fp)
        return entry is not None and entry[0] >= self.deaths

    def quarantined_count(self) -> int:
        """Fingerprints refused now."""
        self._expire()
        return sum(1 for count, _ in self._seen.values() if count >= self.deaths)

    def entries(self) -> list[tuple[str, int, float]]:
        """``(fingerprint, strikes, seconds since the last)`` of every fingerprint remembered, most recent last."""
        self._expire()
        now = self._clock()
        return [(fp, count, now - at) for fp, (count, at) in self._seen.items()]

    def clear(self, fp: str | None = None) -> int:
        """Forget ``fp`` (or every fingerprint; peers too): it is served again. Returns how many were forgotten
        here."""
        self._expire()
        if self.peers is not None and (fp is None or fp in self._seen):  # what no process knows is not sent
            self.peers.publish(Change("cleared", (fp,), self._clock()))
        return self._forget(fp)

    def _forget(self, fp: str | None) -> int:
        if fp is None:
            n = len(self._seen)
            self._seen.clear()
            return n
        return 1 if self._seen.pop(fp, None) is not None else 0

    def check(self, fp: str) -> None:
        """Raises:
        QuarantinedRequestError: ``fp`` is quarantined."""
        if self.is_quarantined(fp):
            raise QuarantinedRequestError(
                f"Request refused: an identical request was charged with {self.deaths} engine faults and is "
                f"quarantined (fingerprint {fp}). Change the request or contact the operator."
            )
