"""The state the guard keeps per server rather than per process (the quarantine's strikes, the per-client fault
budgets), when one server runs several API processes (``--api-server-count N``: :mod:`server.scaleout`).

Each API process keeps its own copy and checks requests against it (no round trip on the request path). A change
made in one process is published to its peers (:class:`Peers`: the owner forwards it to the others), and each
peer takes it in at its next read of that state (:class:`Received`: any thread may add; the reads happen on
the event loop's thread, which alone changes the state)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Change:
    """One change to a per-server state.

    Attributes:
        kind: ``strikes`` (one strike to each fingerprint), ``cleared`` (fingerprints forgotten; ``None``: all),
            ``client_faults`` (one fault charged to each client).
        values: the fingerprints or client keys.
        at: when it was made (``time.monotonic()``, one clock for every process of the machine): a peer that
            takes it in late counts it when it happened (windows, TTLs and cool-downs).
    """

    kind: str
    values: tuple[str | None, ...]
    at: float


class Peers(Protocol):
    """The other API processes of this server."""

    def publish(self, change: Change) -> None:
        """Tell them of ``change`` (made here). Must not block the event loop."""


#: Changes received and not yet taken in, at most; past it the oldest are dropped (a process that reads none
#: of its state for that long, no request in between, keeps at most this many).
RECEIVED_LIMIT = 4096


class Received:
    """Changes made by peers, not yet taken in (thread-safe: ``collections.deque``), at most ``limit``."""

    def __init__(self, limit: int = RECEIVED_LIMIT) -> None:
        self._changes: collections.deque[Change] = collections.deque(maxlen=limit)

    def add(self, change: Change) -> None:
        self._changes.append(change)

    def __bool__(self) -> bool:
        return bool(self._changes)

    def take(self) -> list[Change]:
        """The changes received so far, oldest first (each is taken once)."""
        taken = []
        while self._changes:
            taken.append(self._changes.popleft())
        return taken


__all__ = ["RECEIVED_LIMIT", "Change", "Peers", "Received"]
