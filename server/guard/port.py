"""The narrow port between the guarded engine client and the engine's owner (API process).

The client (:mod:`server.guard.engine_client`) carries requests over faults; the supervisor
(:mod:`server.guard.supervisor`) owns the engine and its fault accounting. All the client asks of the owner
is here: an attempt on the current engine (acquired, admitted, on the in-flight ledger), what happened
during it (output, a cut, a death, an output fault, a suspect's clean end), and the quarantine's verdict.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from server.guard.forensics import Evidence
from server.guard.ipc_cache import EngineCacheShadow
from server.guard.lifecycle import Engine
from server.guard.quarantine import Fingerprint
from server.guard.states import EngineState


@dataclass(frozen=True)
class Attempt:
    """One try of one request on one engine.

    Attributes:
        generation: the engine's generation (a report about a replaced engine is ignored).
        suspect: the request runs on probation, alone (its next fault is charged to it alone).
        ipc_cache: what the engine core holds of the processed images sent to it (None: strip nothing).
    """

    engine: Engine
    generation: int
    suspect: bool
    ipc_cache: EngineCacheShadow | None


class EnginePort(Protocol):
    """What the guarded engine client may ask of the engine's owner."""

    @property
    def state(self) -> EngineState: ...

    @property
    def latest_engine(self) -> Engine:
        """The most recently built engine, alive or not (static attributes: configs, renderer)."""
        ...

    @property
    def max_replays(self) -> int:
        """Engine faults one request may be carried over."""
        ...

    def current_engine(self) -> Engine | None:
        """The READY engine, or None."""
        ...

    def check_quarantine(self, fp: Fingerprint) -> None:
        """Raises :class:`~server.guard.errors.QuarantinedRequestError` when ``fp`` is quarantined."""
        ...

    def attempt(
        self, request_id: str, fp: Fingerprint, evidence: Evidence
    ) -> AbstractAsyncContextManager[Attempt | None]:
        """Wait (bounded) for the READY engine and admit the request (a suspect alone), on the in-flight
        ledger for the block with its ``evidence`` (its client; its forensic record's content); None when
        the engine died while it waited (try again).

        Raises:
            EngineUnavailableError: no engine became READY in time.
        """
        ...

    def output(self, attempt: Attempt) -> None:
        """An output of the attempt arrived (the hang clock restarts)."""
        ...

    def delivered(self, attempt: Attempt) -> None:
        """An output of the attempt was handed on (a suspect progressed)."""
        ...

    def take_cut(self, attempt: Attempt, request_id: str) -> bool:
        """Whether a soft recovery cut the request (answered once per cut)."""
        ...

    def died(self, attempt: Attempt) -> None:
        """The attempt's engine died under it (vLLM's ``EngineDeadError``)."""
        ...

    def output_fault(self, attempt: Attempt, request_id: str, fault: BaseException) -> None:
        """Processing the request's output raised in this process: charged to it alone."""
        ...

    def completed(self, attempt: Attempt, fp: Fingerprint) -> None:
        """The attempt ran to its end (a suspect is cleared)."""
        ...
