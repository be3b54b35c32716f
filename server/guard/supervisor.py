"""The supervisor: owns the vLLM ``AsyncLLM`` engine, notices its death and restarts it in-process.

States (:mod:`server.guard.states`): STARTING -> READY -> DEAD -> RESTARTING -> READY, or FAILED when
restarts keep failing or the restart budget is spent (:mod:`server.guard.restart_policy`); ``on_failed`` is
then called so the server exits non-zero. The HTTP server keeps listening throughout.

Death is noticed three ways: a request's ``generate()`` raising vLLM's ``EngineDeadError`` (reported by
the engine client through :class:`~server.guard.port.EnginePort`), vLLM's ``errored`` flag, and the watch
(:mod:`server.guard.watch`: engine-core process gone or stopped, or requests pending and no step output
for ``hang_timeout``). Engines are built and shut down off the event loop (:mod:`server.guard.builder`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from server.engine.protocol import new_state_dir, read_fatal
from server.guard import watchdog
from server.guard.accounting import FaultAccounting, charged_requests, describe_charge
from server.guard.builder import BuiltEngine, EngineBuilder
from server.guard.errors import EngineUnavailableError
from server.guard.forensics import Evidence, Forensics
from server.guard.hold import HoldPolicy, RebuildPath
from server.guard.inflight import InflightLedger
from server.guard.lifecycle import Engine, EngineFactory, build_async_llm
from server.guard.port import Attempt
from server.guard.quarantine import Fingerprint
from server.guard.restart_policy import RestartBudget, RestartPolicy
from server.guard.spare import Spares
from server.guard.states import EngineState, EngineStates
from server.guard.watch import EngineWatch
from server.guard.watchdog import DeathCause
from server.metrics import definitions as m
from server.settings import GuardSettings

logger = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineFactory",
    "EngineState",
    "EngineUnavailableError",
    "RestartBudget",
    "Supervisor",
    "build_async_llm",
    "charged_requests",
]


class Supervisor:
    """Builds, watches, restarts and shuts down one engine, always built the same way; the engine client's
    :class:`~server.guard.port.EnginePort`.

    Arguments:
        engine_factory: builds a new engine (blocking; run off the event loop). In production
            ``functools.partial(build_async_llm, engine_args)``; tests hand in a fake.
        settings: vlguard's own options (restart budget, hold, quarantine, watchdog).
        on_failed: called once when the state becomes FAILED (the server then exits non-zero).
        state_dir: where engine cores record their fatal errors (see :mod:`server.engine.fatal`); by
            default a new temporary directory. The supervisor removes it at shutdown.
        clock, sleep: monotonic seconds (hang clock, readiness, restart window) and the restart backoff's
            wait (seconds); injectable for tests.
        reap_children: at shutdown, end every process below this one (:meth:`EngineBuilder.shut_down`).
        spares: keeps a spare engine process for rebuilds (:mod:`server.guard.spare`).
        forensics: records each request charged with a fault (:mod:`server.guard.forensics`), or None.
    """

    def __init__(
        self,
        engine_factory: EngineFactory,
        settings: GuardSettings,
        on_failed: Callable[[], None] | None = None,
        state_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        reap_children: bool = False,
        spares: Spares | None = None,
        forensics: Forensics | None = None,
    ) -> None:
        self.settings, self.on_failed, self.clock, self._sleep = settings, on_failed, clock, sleep
        self.state_dir = state_dir or new_state_dir()
        self.generation = 0  # increments with every engine built
        self.states = EngineStates()
        self.holds = HoldPolicy.from_settings(settings)
        self.builder = EngineBuilder(engine_factory, settings, self.state_dir, spares, reap_children, self.holds)
        self.load = self.builder.load  # the current engine's queue and rates (admission: server.api.overload)
        self.restarts = RestartPolicy(settings, clock)
        #: Requests inside an engine now, and the probation slot for suspects.
        self.inflight = InflightLedger(self.holds.base_s, settings.probation_drain_timeout)
        #: strikes, client faults, suspects and soft-recovery cuts (:mod:`server.guard.accounting`)
        self.faults = FaultAccounting(settings, self.inflight, clock, forensics)
        self.forensics = forensics
        self.quarantine, self.clients = self.faults.quarantine, self.faults.clients
        self.watch = EngineWatch(
            settings, clock, self.inflight, self.builder, self._ready_engine, self.report_death, self.absorb_soft_faults
        )
        self._current: BuiltEngine | None = None
        self._latest: Engine | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._restart_task: asyncio.Task[None] | None = None
        self._stop_requested = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- state ---------------------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self.states.current

    @property
    def latest_engine(self) -> Engine:
        """The most recently built engine, alive or not: for static attributes (configs, renderer) that
        vLLM's serving layer may read while a replacement is being built.

        Raises:
            EngineUnavailableError: no engine was ever built.
        """
        if self._latest is None:
            raise EngineUnavailableError(f"engine is {self.state.value}", reason="not_ready")
        return self._latest

    def _ready_engine(self) -> BuiltEngine | None:
        return self._current if self.state is EngineState.READY else None

    def current_engine(self) -> Engine | None:
        """The READY engine, or None."""
        return built.engine if (built := self._ready_engine()) is not None else None

    def is_ready(self) -> bool:
        """READY, not asked to stop, and the engine answered (a probe or real output) within three probe
        intervals."""
        if self.state is not EngineState.READY or self._stop_requested.is_set():
            return False
        return self.watch.answered_within(3 * self.settings.ready_probe_interval)

    def hold_limit(self) -> float:
        """Seconds a request held now (or, while READY, at a death now) waits at most (:mod:`~server.guard.hold`)."""
        path = self.builder.rebuild_path() if self.state is EngineState.READY else self.builder.building_path
        return self.holds.limit(path if self.generation else None)

    def healthy(self) -> bool:
        """Alive and able to recover (for liveness and the systemd watchdog)."""
        return self.state is not EngineState.FAILED

    async def acquire(self) -> tuple[Engine, int]:
        """The READY engine and its generation, waiting (bounded) while it starts or restarts.

        Raises:
            EngineUnavailableError: FAILED or stopped, too many requests already held, or not READY
                within :meth:`hold_limit` seconds.
        """
        while (engine := self.current_engine()) is None:
            await self.states.hold(self.hold_limit, self.settings.max_held)
        return engine, self.generation

    # -- the engine client's port (server.guard.port) -------------------------------------------------
    @property
    def max_replays(self) -> int:
        return self.settings.max_replays

    def check_quarantine(self, fp: Fingerprint) -> None:
        """Raises :class:`~server.guard.errors.QuarantinedRequestError` when ``fp`` is quarantined."""
        if not self.quarantine.empty():  # fp is read only then
            self.quarantine.check(fp.value)

    @asynccontextmanager
    async def attempt(self, request_id: str, fp: Fingerprint, evidence: Evidence) -> AsyncIterator[Attempt | None]:
        """See :meth:`server.guard.port.EnginePort.attempt`. The death of the attempt's engine is reported
        while the request is still on the ledger: it was in flight."""
        engine, generation = self.current_engine(), self.generation  # READY: nothing to await (the common case)
        try:
            engine, generation = (engine, generation) if engine is not None else await self.acquire()
        except EngineUnavailableError as exc:
            m.REQUESTS_FAILED.labels(reason=exc.reason).inc()
            raise
        suspect = self.faults.is_suspect(fp)
        async with self.inflight.probation(suspect):  # others wait while a suspect is isolated
            if generation != self.generation:  # the engine died while this request waited
                yield None
                return
            if not self.inflight:
                self.watch.note_progress(output=False)  # idle -> busy: the hang clock starts now
            with self.inflight.entered(request_id, fp, generation, evidence.client, evidence):
                shadow = self._current.ipc_cache if self._current is not None else None  # this generation's
                yield Attempt(engine, generation, suspect, shadow)

    def output(self, attempt: Attempt) -> None:
        self.watch.note_progress()

    def delivered(self, attempt: Attempt) -> None:
        if attempt.suspect:
            self.inflight.suspect_progressed()

    def take_cut(self, attempt: Attempt, request_id: str) -> bool:
        """Whether a soft recovery of the attempt's engine cut ``request_id`` (it is then carried over; the
        answer is given once per cut, so a later ``ERROR`` finish of the same id is vLLM's own)."""
        self.absorb_soft_faults(attempt.generation)
        return attempt.generation == self.generation and self.faults.take_cut(request_id)

    def died(self, attempt: Attempt) -> None:
        self.report_death(attempt.generation)

    def output_fault(self, attempt: Attempt, request_id: str, fault: BaseException) -> None:
        """Processing ``request_id``'s output raised in this process (:meth:`FaultAccounting.output_fault`).
        Stale generations are ignored."""
        if attempt.generation == self.generation:
            self.faults.output_fault(attempt.generation, request_id, fault)

    def completed(self, attempt: Attempt, fp: Fingerprint) -> None:
        if attempt.suspect:
            self.faults.cleared(fp.value)  # ran to its end on probation: no longer a suspect

    def absorb_soft_faults(self, generation: int) -> None:
        """Count the faults engine ``generation`` absorbed since the last call (soft recovery,
        :mod:`server.engine.soft`; :meth:`FaultAccounting.soft_faults`). Stale generations are ignored."""
        if generation == self.generation:
            self.faults.soft_faults(generation, self.builder.engine_dir(generation))

    # -- start, death and restart ---------------------------------------------------------------------
    async def _bring_up(self) -> None:
        generation = self.generation + 1

        def on_step() -> None:  # the engine delivered a step's outputs: the hang clock restarts
            if generation == self.generation:
                self.watch.note_step()

        built = await self.builder.bring_up(generation, on_step)
        self._current, self._latest = built, built.engine
        self.faults.new_engine()
        self.generation = generation
        self.watch.engine_ready()
        self.states.set(EngineState.READY)
        await self.builder.replenish_spare(built.engine)

    async def start(self) -> None:
        """Build the first engine and start watching it.

        Raises:
            Exception: whatever vLLM raised while building (state becomes FAILED).
        """
        self.states.set(EngineState.STARTING)
        self._loop = asyncio.get_running_loop()
        started = self.clock()
        bring_up = asyncio.ensure_future(self._bring_up())
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait({bring_up, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not bring_up.done():  # SIGTERM/SIGINT while the first engine loads: do not wait for it
                bring_up.cancel()
                self.states.set(EngineState.STOPPED)
                raise EngineUnavailableError("stop requested during start-up", reason="stopped")
            bring_up.result()
        except BaseException:
            bring_up.cancel()
            if self.state is not EngineState.STOPPED:
                self.states.set(EngineState.FAILED)
            raise
        finally:
            stop.cancel()
        self.holds.measured(RebuildPath.COLD, took := self.clock() - started)
        logger.info("engine ready in %.1f s (generation %d)", took, self.generation)
        self._tasks.append(asyncio.create_task(self.watch.run(), name="vlguard-watchdog"))

    def report_death(self, generation: int, cause: DeathCause | None = None) -> None:
        """Declare engine ``generation`` dead (idempotent), charge the quarantine where there is evidence,
        and start the restart.

        Arguments:
            generation: the engine generation the caller saw die; stale reports are ignored.
            cause: known cause (watchdog); None to classify from what the engine core recorded.
        """
        if generation != self.generation or (built := self._ready_engine()) is None:
            return
        record = read_fatal(self.builder.engine_dir(generation))
        if cause is None or (record is not None and cause is DeathCause.PROCESS_EXIT):
            cause = watchdog.classify(record, built.pids)  # an engine core that raised, then exited
        self.states.set(EngineState.DEAD)
        self.builder.building_path = self.builder.rebuild_path()  # until the rebuild arms (or not) its spare
        m.ENGINE_DEATHS.labels(cause=cause.value).inc()
        inflight = self.inflight.requests(generation)
        charged = charged_requests(inflight, record)
        self.faults.charge(inflight, charged, record, "fatal")
        logger.error(
            "engine generation %d died (cause: %s) with %d request(s) in flight; %s; restarting in-process",
            generation, cause.value, len(inflight), describe_charge(inflight, charged)
            if charged else "no request charged (no step raised: a kill, crash or hang is no evidence against one)",
        )  # fmt: skip
        # A fault charged to one request (named, or alone in its step) is its own: its strikes and its
        # client's budget, not the restart budget. A whole step's, a kill, a crash or a hang spend it.
        self._restart_task = asyncio.create_task(self._restart(counted=len(charged) != 1), name="vlguard-restart")

    async def _restart(self, counted: bool = True) -> None:
        """Tear the dead engine down and build a new one, within the restart policy (``counted``: whether
        this death spends the budget; a fault charged to one request does not)."""
        died_at = self.clock()
        built, self._current = self._current, None
        await self.builder.teardown(built)
        gc.unfreeze()  # the dead engine's objects were frozen with the startup heap: let the collector have them
        self.states.set(EngineState.RESTARTING)
        failures = 0
        while self.restarts.may_attempt(counted, failures):
            try:
                await self._bring_up()
            except Exception:
                failures += 1
                self.restarts.failed(failures)
                await self._sleep(self.restarts.backoff(failures))
                continue
            took = self.clock() - died_at
            self.holds.measured(path := self.builder.building_path or RebuildPath.COLD, took)
            self.restarts.succeeded(took)
            logger.info("engine restarted in %.1f s (generation %d, %s)", took, self.generation, path.value)
            return
        spent = self.restarts.budget
        logger.critical("restart budget spent (%d in %.0f s): giving up, exiting non-zero", len(spent), spent.window_s)
        self.states.set(EngineState.FAILED)
        if self.on_failed is not None:
            self.on_failed()

    # -- lifetime ------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """The process was asked to stop (SIGTERM/SIGINT): a first start-up in progress is abandoned.
        Safe to call from a signal handler (it only schedules work on the supervisor's loop)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_requested.set)

    async def shutdown(self) -> None:
        """Stop watching, end the spare, shut the engine down (:meth:`EngineBuilder.shut_down`: each stage
        bounded by ``settings.shutdown_timeout`` s; worst case three bounds plus 20 s); idempotent, never raises."""
        for task in [*self._tasks, self._restart_task]:
            if task is not None:
                task.cancel()
        self._tasks.clear()
        await self.builder.close_spare()  # the engine stays in reach meanwhile
        built, self._current, self._latest = self._current, None, None
        await self.builder.shut_down(built.engine if built is not None else None)
        if self.forensics is not None:
            self.forensics.close(wait=False)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if self.state is not EngineState.FAILED:
            self.states.set(EngineState.STOPPED)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Supervisor]:
        """Start the engine for the duration of the block; always shut it down afterwards."""
        try:
            await self.start()
            yield self
        finally:
            await self.shutdown()
