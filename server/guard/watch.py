"""The engine's watch (API process): liveness and readiness in one loop, like vLLM's own watchdog task.

Every ``watchdog_interval`` seconds, for the READY engine: the engine-core processes (gone, a zombie, or
stopped: :mod:`server.guard.watchdog`), vLLM's ``errored`` flag, the hang clock (requests in flight and no
step output for ``hang_timeout``), the soft faults the engine core absorbed, the spare process; and, when
no request is in flight and the engine has not answered for ``ready_probe_interval``, a one-token probe.
A problem is reported as a death (``on_death``); the supervisor decides what follows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from server.engine.protocol import read_fatal
from server.guard import watchdog
from server.guard.builder import BuiltEngine, EngineBuilder, probe
from server.guard.inflight import InflightLedger
from server.guard.watchdog import DeathCause
from server.settings import GuardSettings

logger = logging.getLogger("server.guard.supervisor")


class EngineWatch:
    """The hang clock, the readiness clock, and the loop that checks them.

    Arguments:
        settings: ``watchdog_interval``, ``hang_timeout``, ``ready_probe_interval`` (seconds).
        clock: monotonic seconds.
        inflight: the requests inside the engine (an idle engine is probed, a busy one must progress).
        builder: the engines' record directories and the spare process.
        current: the READY engine, or None.
        on_death: declare engine ``generation`` dead, with the cause when known (None: from its record).
        on_soft_faults: count the faults engine ``generation`` absorbed since the last call.
    """

    def __init__(
        self,
        settings: GuardSettings,
        clock: Callable[[], float],
        inflight: InflightLedger,
        builder: EngineBuilder,
        current: Callable[[], BuiltEngine | None],
        on_death: Callable[[int, DeathCause | None], None],
        on_soft_faults: Callable[[int], None],
    ) -> None:
        self.settings, self.clock, self.inflight, self.builder = settings, clock, inflight, builder
        self._current, self._on_death, self._on_soft_faults = current, on_death, on_soft_faults
        self.last_progress = clock()  # hang clock: last output, or when work arrived at an idle engine
        self.last_output = 0.0  # readiness: real output is as good as a probe
        self.probe_ok_at: float | None = None

    def engine_ready(self) -> None:
        """A new engine answered its probe: both clocks start now."""
        self.last_progress = self.last_output = self.probe_ok_at = self.clock()

    def note_progress(self, output: bool = True) -> None:
        """Restart the hang clock: the engine produced output, or (``output=False``) work arrived at an idle
        engine."""
        self.last_progress = self.clock()
        if output:
            self.last_output = self.last_progress

    def note_step(self) -> None:
        """Restart the hang clock: the engine delivered a step's outputs (any request, any output kind)."""
        self.last_progress = self.clock()

    def answered_within(self, seconds: float) -> bool:
        """Whether the engine answered (a probe or real output) within the last ``seconds``."""
        return self.clock() - max(self.probe_ok_at or 0.0, self.last_output) <= seconds

    async def run(self) -> None:
        """Check every ``watchdog_interval`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.settings.watchdog_interval)
            try:
                await self.check()
            except Exception:
                logger.exception("watchdog check failed")

    async def check(self) -> None:
        """One check of the READY engine (none: nothing to do)."""
        if self._current() is None:
            return
        await self.builder.check_spare()
        if (built := self._current()) is None:  # it died while the spare was checked
            return
        engine, generation = built.engine, built.generation
        self._on_soft_faults(generation)
        problem = watchdog.process_problem(built.pids)
        if problem is None and engine.errored:
            problem = watchdog.classify(read_fatal(self.builder.engine_dir(generation)), built.pids)
        if problem is None and self.inflight and self.clock() - self.last_progress > self.settings.hang_timeout:
            problem = DeathCause.HANG
        if problem is not None:
            self._on_death(generation, problem)
            return
        # Real output is as good as a probe (as for readiness): an engine serving traffic is not probed
        # at each idle moment between requests.
        if not self.inflight and not self.answered_within(self.settings.ready_probe_interval):
            try:
                await asyncio.wait_for(probe(engine), self.settings.hang_timeout)
                self.probe_ok_at = self.clock()
            except Exception:  # a stale generation's report is ignored
                self._on_death(generation, DeathCause.HANG if not engine.errored else None)
