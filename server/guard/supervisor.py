"""The supervisor: owns the vLLM ``AsyncLLM`` engine, notices its death and restarts it in-process.

States: STARTING -> READY -> DEAD -> RESTARTING -> READY, or FAILED when restarts keep failing or the
restart budget (``restart_max`` within ``restart_window``) is spent; ``on_failed`` is then called so the
server exits non-zero. The HTTP server keeps listening throughout.

Death is noticed three ways: a request's ``generate()`` raising vLLM's ``EngineDeadError`` (reported by
the engine client), vLLM's ``errored`` flag, and the watchdog (engine-core process gone or stopped, or
requests pending and no step output from the engine core for ``hang_timeout``). Engines are built and
shut down off the event loop (``AsyncLLM`` start-up blocks for the whole model load).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import gc
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from server.engine.protocol import EngineSettings, engine_dir, new_state_dir, read_fatal
from server.guard import ipc_cache, output_faults, watchdog
from server.guard.accounting import FaultAccounting, charged_requests, describe_charge
from server.guard.errors import EngineUnavailableError
from server.guard.inflight import InflightLedger
from server.guard.ipc_cache import EngineCacheShadow
from server.guard.lifecycle import Engine, EngineFactory, ServingRenderer, build_async_llm, in_daemon_thread, teardown
from server.guard.spare import SpareKeeper
from server.guard.watchdog import DeathCause
from server.metrics import definitions as m
from server.settings import GuardSettings
from server.vllm_hooks import async_llm

if TYPE_CHECKING:
    import psutil

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


#: The readiness probe's prompt (token ids; any valid id does: one token is generated from it).
PROBE_PROMPT_IDS = (0,)


class RestartBudget:
    """At most ``max_restarts`` counted rebuilds within a sliding ``window_s`` seconds.

    Arguments:
        clock: monotonic seconds.
    """

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float]) -> None:
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._restarts: collections.deque[float] = collections.deque()

    def spent(self) -> bool:
        """Whether the budget is spent now (old restarts leave the window first)."""
        now = self.clock()
        while self._restarts and now - self._restarts[0] > self.window_s:
            self._restarts.popleft()
        return len(self._restarts) >= self.max_restarts

    def spend(self) -> None:
        """Count a restart (attempt) now."""
        self._restarts.append(self.clock())

    def __len__(self) -> int:
        return len(self._restarts)


class EngineState(enum.StrEnum):
    """Lifecycle state of the supervised engine."""

    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class Supervisor:
    """Builds, watches, restarts and shuts down one engine, always built the same way.

    Arguments:
        engine_factory: builds a new engine (blocking; run off the event loop). In production
            ``functools.partial(build_async_llm, engine_args)``; tests hand in a fake.
        settings: vlguard's own options (restart budget, hold, quarantine, watchdog).
        on_failed: called once when the state becomes FAILED (the server then exits non-zero).
        state_dir: where engine cores record their fatal errors (see :mod:`server.engine.fatal`); by
            default a new temporary directory. The supervisor removes it at shutdown.
        clock: monotonic seconds (hang clock, readiness, restart window); injectable for tests.
        sleep: awaited for the restart backoff (seconds); injectable for tests.
        reap_children: at shutdown, end every process below this one (the engine's, and whatever an
            unfinished build spawned). For ``vlguard serve``, where the API process has no other
            children; off where the supervisor shares its process (tests).
        spares: keeps a spare engine process for rebuilds (:mod:`server.guard.spare`); None: every
            rebuild spawns its processes.
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
        spares: SpareKeeper | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.spares = spares
        self.reap_children = reap_children
        self.settings = settings
        self.on_failed = on_failed
        self.state_dir = state_dir or new_state_dir()
        self.clock = clock
        self._sleep = sleep
        self.generation = 0  # increments with every engine built
        self.state = EngineState.STOPPED
        self._engine: Engine | None = None
        self._latest: Engine | None = None
        self._renderer = ServingRenderer()
        self._pids: list[int] = []
        self._tree: list[psutil.Process] = []
        self._settled = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) at every state change
        self._held = 0
        self._restarts = RestartBudget(settings.restart_max, settings.restart_window, clock)
        self._restart_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._building: asyncio.Future[Engine] | None = None  # an engine build running in a thread
        self._stop_requested = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: True when shutdown had to leave a build behind in its daemon thread (it does not hold the exit).
        self.abandoned_build = False
        #: Requests inside an engine now, and the probation slot for suspects.
        self.inflight = InflightLedger(settings.hold_timeout, settings.probation_drain_timeout)
        #: strikes, client faults, suspects and soft-recovery cuts (:mod:`server.guard.accounting`)
        self.faults = FaultAccounting(settings, self.inflight, clock)
        self.quarantine, self.clients = self.faults.quarantine, self.faults.clients
        self.last_progress = clock()  # hang clock: last output, or when work arrived at an idle engine
        self.last_output = 0.0  # readiness: real output is as good as a probe
        self.probe_ok_at: float | None = None
        self._ipc_cache: EngineCacheShadow | None = None  # what the current engine core's cache holds
        self._set_state(EngineState.STOPPED)
        m.RESTART_BUDGET.set(settings.restart_max)

    # -- state ---------------------------------------------------------------------------------------
    def _set_state(self, state: EngineState) -> None:
        self.state = state
        for s in EngineState:
            m.ENGINE_STATE.labels(state=s.value).set(1 if s is state else 0)
        m.ENGINE_UP.set(1 if state is EngineState.READY else 0)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        # Waiters wake when the state settles (READY, or FAILED/STOPPED to be refused), not while in between.
        if state in (EngineState.READY, EngineState.FAILED, EngineState.STOPPED):
            self._settled.set()
        else:
            self._settled.clear()

    async def wait_for_state(self, *states: EngineState) -> EngineState:
        """Wait until the state is one of ``states`` (no timeout: wrap it in one) and return it."""
        while self.state not in states:
            await self._changed.wait()
        return self.state

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

    @property
    def engine(self) -> Engine:
        """The current engine.

        Raises:
            EngineUnavailableError: no engine is READY.
        """
        if self._engine is None or self.state is not EngineState.READY:
            raise EngineUnavailableError(f"engine is {self.state.value}", reason="not_ready")
        return self._engine

    def is_ready(self) -> bool:
        """READY, not asked to stop, and the engine answered (a probe or real output) within three probe
        intervals."""
        if self.state is not EngineState.READY or self._stop_requested.is_set():
            return False
        last = max(self.probe_ok_at or 0.0, self.last_output)
        return self.clock() - last <= 3 * self.settings.ready_probe_interval

    def healthy(self) -> bool:
        """Alive and able to recover (for liveness and the systemd watchdog)."""
        return self.state is not EngineState.FAILED

    async def acquire(self) -> tuple[Engine, int]:
        """The READY engine and its generation, waiting (bounded) while it starts or restarts.

        Raises:
            EngineUnavailableError: FAILED or stopped, too many requests already held, or not READY
                within ``hold_timeout`` seconds.
        """
        if self.state is EngineState.READY and self._engine is not None:
            return self._engine, self.generation
        if self.state in (EngineState.FAILED, EngineState.STOPPED):
            raise EngineUnavailableError(f"engine is {self.state.value}", reason="engine_failed")
        if self._held >= self.settings.max_held:
            raise EngineUnavailableError("too many requests waiting for the engine", reason="too_many_held")
        self._held += 1
        m.REQUESTS_HELD.set(self._held)
        try:
            await asyncio.wait_for(self._settled.wait(), self.settings.hold_timeout)
        except TimeoutError:
            raise EngineUnavailableError(
                f"engine not ready within {self.settings.hold_timeout:g} s ({self.state.value})"
            ) from None
        finally:
            self._held -= 1
            m.REQUESTS_HELD.set(self._held)
        return await self.acquire()

    # -- building ------------------------------------------------------------------------------------
    async def probe(self, engine: Engine) -> None:
        """Generate one token from a fixed one-token prompt (readiness probe).

        The prompt is given as token ids: a text prompt is tokenized on the event loop's thread with the
        tokenizer vLLM's request tokenizer uses in its own thread, and the Rust tokenizer refuses concurrent
        use ("RuntimeError: Already borrowed": a request got a 500 under load when a probe ran beside it).

        Raises:
            Exception: whatever the engine raised.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0)
        prompt = {"prompt_token_ids": list(PROBE_PROMPT_IDS)}
        async for _ in engine.generate(prompt, params, f"vlguard-probe-{time.monotonic_ns()}"):
            pass
        self.probe_ok_at = self.clock()

    def engine_dir(self, generation: int) -> Path:
        """Where engine ``generation``'s engine core writes its records (:mod:`server.engine.protocol`)."""
        return engine_dir(self.state_dir, generation)

    async def _bring_up(self) -> None:
        directory = self.engine_dir(self.generation + 1)
        directory.mkdir(parents=True, exist_ok=True)
        # Inherited by the engine-core process this build spawns (server.engine.fatal, server.engine.soft).
        EngineSettings(
            str(directory), self.settings.soft_recovery, self.settings.soft_recovery_max, self.settings.restart_window
        ).apply()
        if self.spares is not None and self.generation:
            self.spares.arm()  # a rebuild: its engine core runs in the spare, its worker in the spare's
        building = self._building = in_daemon_thread(self.engine_factory)
        try:
            # shield: a cancelled wait (shutdown) leaves the build to shutdown(), which ends it
            engine = await asyncio.wait_for(asyncio.shield(building), self.settings.startup_timeout)
        finally:
            if building.done():
                self._building = None
            if self.spares is not None:
                self.spares.after_build()
        try:
            await engine.reset_mm_cache()  # drop the profiling run's dummy images
            self._renderer.adopt(engine)
            await asyncio.wait_for(self.probe(engine), self.settings.startup_timeout)
        except BaseException:
            self._renderer.release(engine)
            await asyncio.to_thread(engine.shutdown)
            raise
        generation = self.generation + 1
        async_llm.on_engine_core_output(engine, lambda: self._note_engine_step(generation))
        if (processor := async_llm.output_processor_of(engine)) is not None:
            output_faults.confine(processor)  # a request whose output processing raises costs only itself
        self._engine = self._latest = engine
        self._ipc_cache = ipc_cache.shadow_for(engine)
        self._renderer.keep(engine)
        self._pids = async_llm.engine_core_pids(engine)
        self._tree = watchdog.process_tree(self._pids)  # workers too: orphaned once their engine core dies
        self.faults.new_engine()
        self.generation += 1
        self.last_progress = self.last_output = self.clock()
        if self.generation > 1:  # a restart: freeze the new engine's objects, as the app does at start-up
            from vllm.utils.gc_utils import freeze_gc_heap

            freeze_gc_heap()
        self._set_state(EngineState.READY)
        if self.spares is not None and (config := getattr(engine, "vllm_config", None)) is not None:
            try:
                await asyncio.to_thread(self.spares.replenish, config)  # spawning pickles the config: blocks
            except Exception:  # the engine serves without a spare; the next rebuild spawns
                logger.exception("spare engine process not started")

    async def start(self) -> None:
        """Build the first engine and start watching it.

        Raises:
            Exception: whatever vLLM raised while building (state becomes FAILED).
        """
        self._set_state(EngineState.STARTING)
        self._loop = asyncio.get_running_loop()
        started = self.clock()
        bring_up = asyncio.ensure_future(self._bring_up())
        stop = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait({bring_up, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not bring_up.done():  # SIGTERM/SIGINT while the first engine loads: do not wait for it
                bring_up.cancel()
                self._set_state(EngineState.STOPPED)
                raise EngineUnavailableError("stop requested during start-up", reason="stopped")
            bring_up.result()
        except BaseException:
            bring_up.cancel()
            if self.state is not EngineState.STOPPED:
                self._set_state(EngineState.FAILED)
            raise
        finally:
            stop.cancel()
        logger.info("engine ready in %.1f s (generation %d)", self.clock() - started, self.generation)
        self._tasks.append(asyncio.create_task(self._watch_forever(), name="vlguard-watchdog"))

    # -- death and restart ---------------------------------------------------------------------------
    def report_death(self, generation: int, cause: DeathCause | None = None) -> None:
        """Declare engine ``generation`` dead (idempotent), charge the quarantine where there is evidence,
        and start the restart.

        Arguments:
            generation: the engine generation the caller saw die; stale reports are ignored.
            cause: known cause (watchdog); None to classify from what the engine core recorded.
        """
        if generation != self.generation or self.state is not EngineState.READY:
            return
        record = read_fatal(self.engine_dir(generation))
        if cause is None or (record is not None and cause is DeathCause.PROCESS_EXIT):
            cause = watchdog.classify(record, self._pids)  # an engine core that raised, then exited
        self._set_state(EngineState.DEAD)
        m.ENGINE_DEATHS.labels(cause=cause.value).inc()
        inflight = self.inflight.requests(generation)
        charged = charged_requests(inflight, record)
        self.faults.charge(inflight, charged, record)
        logger.error(
            "engine generation %d died (cause: %s) with %d request(s) in flight; %s; restarting in-process",
            generation, cause.value, len(inflight), describe_charge(inflight, charged)
            if charged else "no request charged (no step raised: a kill, crash or hang is no evidence against one)",
        )  # fmt: skip
        # A fault charged to one request (named, or alone in its step) is its own: its strikes and its
        # client's budget, not the restart budget. A whole step's, a kill, a crash or a hang spend it.
        self._restart_task = asyncio.create_task(self._restart(counted=len(charged) != 1), name="vlguard-restart")

    def is_suspect(self, fp: str) -> bool:
        """Whether ``fp`` runs on probation (:meth:`FaultAccounting.is_suspect`)."""
        return self.faults.is_suspect(fp)

    def cleared(self, fp: str) -> None:
        """``fp`` ran to its end on probation (:meth:`FaultAccounting.cleared`)."""
        self.faults.cleared(fp)

    def absorb_soft_faults(self, generation: int) -> None:
        """Count the faults engine ``generation`` absorbed since the last call (soft recovery,
        :mod:`server.engine.soft`; :meth:`FaultAccounting.soft_faults`). Called by the engine client when
        a request ends in an ``ERROR`` finish, and by the watchdog. Stale generations are ignored."""
        if generation == self.generation:
            self.faults.soft_faults(generation, self.engine_dir(generation))

    def output_fault(self, generation: int, request_id: str, fault: BaseException) -> None:
        """Processing ``request_id``'s output raised in this process (:meth:`FaultAccounting.output_fault`).
        Stale generations are ignored."""
        if generation == self.generation:
            self.faults.output_fault(generation, request_id, fault)

    def ipc_cache(self, generation: int) -> EngineCacheShadow | None:
        """What engine ``generation``'s engine core holds of the processed images sent to it (None: strip
        nothing; a stale generation, or an engine core without a receiver cache)."""
        return self._ipc_cache if generation == self.generation else None

    def take_cut(self, generation: int, request_id: str) -> bool:
        """Whether a soft recovery of engine ``generation`` cut ``request_id`` (it is then carried over; the
        answer is given once per cut, so a later ``ERROR`` finish of the same id is vLLM's own)."""
        self.absorb_soft_faults(generation)
        return generation == self.generation and self.faults.take_cut(request_id)

    async def _teardown(self) -> None:
        engine, self._engine = self._engine, None
        pids, self._pids, tree, self._tree = self._pids, [], self._tree, []
        await teardown(engine, pids, tree, self._renderer)

    async def _restart(self, counted: bool = True) -> None:
        """Tear the dead engine down and build a new one, within the restart budget (``counted``: whether
        this death spends it; a fault charged to requests does not)."""
        died_at = self.clock()
        await self._teardown()
        gc.unfreeze()  # the dead engine's objects were frozen with the startup heap: let the collector have them
        self._set_state(EngineState.RESTARTING)
        failures = 0
        while True:
            if self._restarts.spent():
                logger.critical(
                    "restart budget spent (%d in %.0f s): giving up, exiting non-zero",
                    len(self._restarts), self.settings.restart_window,
                )  # fmt: skip
                self._fail()
                return
            if counted or failures:  # a failed attempt always counts: the engine, not a request, is at fault
                self._restarts.spend()
            try:
                await self._bring_up()
            except Exception:
                failures += 1
                m.ENGINE_RESTARTS.labels(outcome="failure").inc()
                logger.exception("engine restart attempt failed (%d)", failures)
                await self._sleep(self.settings.restart_backoff * 2 ** (failures - 1))  # exponential backoff
                continue
            m.ENGINE_RESTARTS.labels(outcome="success").inc()
            m.RESTART_DURATION.observe(self.clock() - died_at)
            m.ENGINE_RECOVERIES.labels(kind="rebuild").inc()
            m.RECOVERY_DURATION.labels(kind="rebuild").observe(self.clock() - died_at)
            logger.info("engine restarted in %.1f s (generation %d)", self.clock() - died_at, self.generation)
            return

    def _fail(self) -> None:
        self._set_state(EngineState.FAILED)
        if self.on_failed is not None:
            self.on_failed()

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.watchdog_interval)
            try:
                await self._check()
            except Exception:
                logger.exception("watchdog check failed")

    async def _check(self) -> None:
        if self.state is not EngineState.READY or self._engine is None:
            return
        if self.spares is not None:
            try:
                await asyncio.to_thread(self.spares.check)
            except Exception:
                logger.exception("spare engine process not replaced")
        engine, generation = self._engine, self.generation
        self.absorb_soft_faults(generation)
        problem = watchdog.process_problem(self._pids)
        if problem is None and engine.errored:
            problem = watchdog.classify(read_fatal(self.engine_dir(generation)), self._pids)
        if problem is None and self.inflight and self.clock() - self.last_progress > self.settings.hang_timeout:
            problem = DeathCause.HANG
        if problem is not None:
            self.report_death(generation, problem)
            return
        idle = not self.inflight
        # Real output is as good as a probe (as for readiness): an engine serving traffic is not probed
        # at each idle moment between requests.
        answered = max(self.probe_ok_at or 0.0, self.last_output)
        probe_due = self.clock() - answered > self.settings.ready_probe_interval
        if idle and probe_due:
            try:
                await asyncio.wait_for(self.probe(engine), self.settings.hang_timeout)
            except Exception:
                if self.generation == generation:
                    self.report_death(generation, DeathCause.HANG if not engine.errored else None)

    def note_progress(self, output: bool = True) -> None:
        """Restart the hang clock: the engine produced output, or (``output=False``) work arrived at an idle
        engine. Called by the engine client."""
        self.last_progress = self.clock()
        if output:
            self.last_output = self.last_progress

    # -- lifetime ------------------------------------------------------------------------------------
    def _note_engine_step(self, generation: int) -> None:
        """Restart the hang clock: engine ``generation`` delivered a step's outputs (any request, any
        output kind; see :func:`server.vllm_hooks.async_llm.on_engine_core_output`)."""
        if generation == self.generation:
            self.last_progress = self.clock()

    def request_stop(self) -> None:
        """The process was asked to stop (SIGTERM/SIGINT): a first start-up in progress is abandoned.
        Safe to call from a signal handler (it only schedules work on the supervisor's loop)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_requested.set)

    async def shutdown(self) -> None:
        """Stop watching and shut the engine down; idempotent, never raises. Each stage is bounded by
        ``settings.shutdown_timeout`` seconds: the engine's own shutdown; an engine still being built
        (what it spawned is killed until it gives up; a build that does not is left, ``abandoned_build``,
        in its daemon thread); with ``reap_children``, every process below this one but multiprocessing's
        resource tracker (SIGTERM, then SIGKILL). Worst case about three bounds plus 20 s."""
        for task in [*self._tasks, self._restart_task]:
            if task is not None:
                task.cancel()
        self._tasks.clear()
        if self.spares is not None:
            await asyncio.to_thread(self.spares.close)
        engine, self._engine, self._latest = self._engine, None, None
        bound = self.settings.shutdown_timeout
        if engine is not None:
            self._renderer.shutdown_own(engine)
            try:
                await asyncio.wait_for(asyncio.to_thread(engine.shutdown), bound)
            except Exception:
                logger.exception("engine shutdown did not complete cleanly")
        await self._end_build(bound)
        if self.reap_children:
            await asyncio.to_thread(watchdog.end_descendants, bound)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if self.state is not EngineState.FAILED:
            self._set_state(EngineState.STOPPED)

    async def _end_build(self, bound_s: float) -> None:
        """End an engine build still running in its thread: kill what it spawned (with ``reap_children``)
        until it gives up, then shut down whatever it built. Gives up after ``bound_s`` seconds."""
        building, self._building = self._building, None
        if building is None:
            return
        loop = asyncio.get_running_loop()  # wall-clock bound: the injectable clock is for the engine's timers
        deadline = loop.time() + bound_s
        while not building.done() and loop.time() < deadline:
            if self.reap_children:
                await asyncio.to_thread(watchdog.end_descendants, 0.0)  # its handshake with the engine then fails
            await asyncio.wait({building}, timeout=0.5)
        if not building.done():
            logger.error("an engine build did not end within %.0f s of shutdown; leaving it", bound_s)
            self.abandoned_build = True
            return
        if not building.cancelled() and building.exception() is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(building.result().shutdown), bound_s)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Supervisor]:
        """Start the engine for the duration of the block; always shut it down afterwards."""
        try:
            await self.start()
            yield self
        finally:
            await self.shutdown()
