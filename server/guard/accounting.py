"""Fault accounting: what an engine fault costs, and whom (API process).

Turns what an engine core recorded (:mod:`server.engine.protocol`: a fatal record before it died, a
soft-fault record when it absorbed a step fault) and faults raised in this process's output processing
(:mod:`server.guard.output_faults`) into:

- **strikes**: each request charged with a fault gets one (:mod:`server.guard.quarantine`); a request with
  a strike runs on probation; one with ``quarantine_deaths`` strikes is refused;
- **client faults**: a fault that named one request alone charges that request's client
  (:mod:`server.guard.clients`);
- **suspects**: a fault that named nobody puts every request the engine held on probation, once;
- **cuts**: the requests a soft recovery finished with ``ERROR``, for the engine client to carry over
  (:meth:`FaultAccounting.take_cut`).

Whether a fault rebuilds the engine, and whether it spends the restart budget, is the supervisor's
decision (:mod:`server.guard.supervisor`); this module only counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from server.engine.protocol import FatalRecord, SoftFault, api_ids, format_traceback, read_soft_faults
from server.guard import watchdog
from server.guard.clients import ClientBudget
from server.guard.forensics import Charge, Forensics
from server.guard.inflight import InflightLedger
from server.guard.quarantine import Fingerprint, Quarantine
from server.metrics import definitions as m
from server.settings import GuardSettings

logger = logging.getLogger(__name__)


def charged_requests(inflight: dict[str, str], record: FatalRecord | SoftFault | None) -> list[str]:
    """The in-flight request ids a fault is charged to: those in the step the engine core recorded as
    failing (engine-side ids mapped back by :func:`server.engine.protocol.api_ids`).

    Arguments:
        inflight: request id -> fingerprint of the requests inside the engine.
        record: what its engine core recorded (before dying, or when it absorbed the fault), or None.

    Returns:
        Sorted request ids; empty without a record (a SIGKILL, segfault or OOM kill of the engine core, or
        a hang, says nothing about the requests in flight).
    """
    if record is None or not record.step_requests:
        return []
    step = api_ids(record.step_requests)
    return sorted(rid for rid in inflight if rid in step)


def describe_charge(inflight: dict[str, str], charged: list[str]) -> str:
    """A log line's account of whom a fault was charged to (fingerprints, never request text)."""
    if not charged:
        return "no request charged"
    fingerprints = ", ".join(sorted({inflight[r] for r in charged}))
    return f"charged to the {len(charged)} request(s) of the failing step: {fingerprints}"


class FaultAccounting:
    """Strikes, client faults, suspects and soft-recovery cuts of the engines one supervisor runs.

    Arguments:
        settings: vlguard's options (quarantine, client budget, restart window).
        inflight: the requests inside each engine (who to charge, and their clients).
        clock: monotonic seconds.
        forensics: writes a record of each request charged (``--guard-forensics-dir``), or None.
    """

    def __init__(
        self,
        settings: GuardSettings,
        inflight: InflightLedger,
        clock: Callable[[], float],
        forensics: Forensics | None = None,
    ) -> None:
        self.settings = settings
        self.inflight = inflight
        self.forensics = forensics
        self.quarantine = Quarantine(
            settings.quarantine_deaths, settings.quarantine_size, settings.quarantine_ttl, clock=clock
        )
        #: per-client fault budget (:mod:`server.guard.clients`)
        self.clients = ClientBudget(
            settings.client_fault_max, settings.restart_window, settings.client_cooldown, clock=clock
        )
        #: fingerprints to run on probation without a strike: in the engine when a fault named no request
        self.suspects: set[str] = set()
        self._soft_read: set[str] = set()  # soft-fault records of the current engine already counted
        self._soft_cut: set[str] = set()  # API-side ids of the requests they cut

    def new_engine(self) -> None:
        """A new engine serves: its records and cuts start empty."""
        self._soft_read, self._soft_cut = set(), set()

    def charge(
        self, inflight: dict[str, str], charged: list[str], record: FatalRecord | SoftFault | None, kind: str
    ) -> None:
        """Give each charged request (id -> fingerprint in ``inflight``) a strike; charge its client's fault
        budget when the fault named that request alone; put a fault's suspects (it named nobody) on
        probation; write each charged request's forensic record (``kind``: ``fatal``, ``soft``,
        ``output``)."""
        evidence = "named" if record is not None and record.named else "step_exception"
        if charged:
            m.QUARANTINE_STRIKES.labels(evidence=evidence).inc(len(charged))
        for fp in self.quarantine.record_death(inflight[rid] for rid in charged):
            logger.error("request %s quarantined: charged with %d engine faults", fp, self.quarantine.deaths)
        m.QUARANTINED.set(self.quarantine.quarantined_count())
        if self.forensics is not None and record is not None:
            self._record(inflight, charged, record, kind)
        if len(charged) == 1 and (client := self.inflight.client_of(charged[0])):
            m.CLIENT_FAULTS.inc()
            for refused in self.clients.charge([client]):
                logger.error("client %s refused for %.0f s: its requests caused %d engine faults",
                             refused, self.settings.client_cooldown, self.settings.client_fault_max)  # fmt: skip
            m.CLIENTS_REFUSED.set(self.clients.refused_count())
        if record is not None and record.suspects and not charged:
            suspects = api_ids(record.suspects)
            self.suspects |= {fp for rid, fp in inflight.items() if rid in suspects}
            while len(self.suspects) > self.settings.quarantine_size:
                self.suspects.pop()

    def _record(self, inflight: dict[str, str], charged: list[str], record: FatalRecord | SoftFault, kind: str) -> None:
        assert self.forensics is not None
        for rid in charged:
            fp = inflight[rid]
            peers = [(r, inflight[r]) for r in charged if r != rid]
            charge = Charge(kind, record, peers, self.quarantine.is_quarantined(fp))
            self.forensics.charged(rid, fp, self.inflight.evidence_of(rid), charge)

    def is_suspect(self, fp: Fingerprint) -> bool:
        """Whether ``fp`` runs on probation: it has a strike, or was in the engine at a fault that named no
        request (until it completes once). ``fp`` is read only while anything is on probation."""
        if not self.suspects and self.quarantine.empty():
            return False
        return fp.value in self.suspects or self.quarantine.strikes(fp.value) > 0

    def cleared(self, fp: str) -> None:
        """``fp`` ran to its end on probation: no longer a suspect (its strikes stay)."""
        self.suspects.discard(fp)

    def soft_faults(self, generation: int, directory: Path) -> None:
        """Count the faults engine ``generation`` absorbed since the last call (its records in
        ``directory``): metrics, strikes for the requests of each failing step, a log line each; remember
        the requests each one cut."""
        for name, record in read_soft_faults(directory, skip=self._soft_read):
            self._soft_read.add(name)
            self._soft_cut |= api_ids(record.cut)
            cause = watchdog.exception_cause(record.describe())
            m.ENGINE_DEATHS.labels(cause=cause.value).inc()
            m.ENGINE_RECOVERIES.labels(kind="soft").inc()
            m.RECOVERY_DURATION.labels(kind="soft").observe(record.recovery_s)
            inflight = self.inflight.requests(generation)
            charged = charged_requests(inflight, record)
            self.charge(inflight, charged, record, "soft")
            logger.error(
                "engine generation %d: step fault (cause: %s) absorbed in %.3f s; %d request(s) cut and carried "
                "over; %s: %s",
                generation, cause.value, record.recovery_s, len(record.cut), describe_charge(inflight, charged),
                record.describe()[:500],
            )  # fmt: skip

    def take_cut(self, request_id: str) -> bool:
        """Whether a soft recovery of the current engine cut ``request_id`` (read its records first: see
        :meth:`soft_faults`). The answer is given once per cut: a later ``ERROR`` finish is vLLM's own."""
        if request_id not in self._soft_cut:
            return False
        self._soft_cut.discard(request_id)
        return True

    def output_fault(self, generation: int, request_id: str, fault: BaseException) -> None:
        """Processing ``request_id``'s output raised in this process (:mod:`server.guard.output_faults`): a
        fault named to that request, absorbed without touching the engine (counted as a soft recovery)."""
        inflight = self.inflight.requests(generation)
        record = SoftFault(type(fault.__cause__ or fault).__name__, str(fault)[:2000], [request_id], [],
                           [request_id], 0.0, named=True, traceback=format_traceback(fault))  # fmt: skip
        m.ENGINE_DEATHS.labels(cause=watchdog.exception_cause(record.describe()).value).inc()
        m.ENGINE_RECOVERIES.labels(kind="soft").inc()
        m.RECOVERY_DURATION.labels(kind="soft").observe(0.0)
        self.charge(inflight, [request_id] if request_id in inflight else [], record, "output")
        logger.error(
            "engine generation %d: processing the output of request %s (%s) failed; charged to it and carried "
            "over: %s", generation, request_id, inflight.get(request_id), record.describe()[:300],
        )  # fmt: skip
