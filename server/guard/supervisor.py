"""The supervisor: owns the vLLM ``AsyncLLM`` engine, notices its death and restarts it in-process.

States: STARTING -> READY -> DEAD -> RESTARTING -> READY, or FAILED when restarts keep failing or the
restart budget (``restart_max`` within ``restart_window``) is spent; ``on_failed`` is then called so the
server exits non-zero. The HTTP server keeps listening throughout.

Death is noticed three ways: a request's ``generate()`` raising vLLM's ``EngineDeadError`` (reported by
the engine client), vLLM's ``errored`` flag, and the watchdog (engine-core process gone or stopped, or
requests pending with no output for ``hang_timeout``). Engines are built and shut down off the event
loop (``AsyncLLM`` start-up blocks for the whole model load).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import gc
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from server.guard import watchdog
from server.guard.fatal import read_fatal
from server.guard.quarantine import Quarantine
from server.guard.watchdog import DeathCause
from server.metrics import definitions as m
from server.metrics.registry import mark_process_dead
from server.settings import GuardSettings

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class EngineState(str, enum.Enum):
    """Lifecycle state of the supervised engine."""

    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class EngineUnavailableError(RuntimeError):
    """No engine is READY within the hold timeout (starting, restarting, failed or stopped). HTTP 503."""

    def __init__(self, message: str, reason: str = "hold_timeout") -> None:
        super().__init__(message)
        self.reason = reason


class Supervisor:
    """Builds, watches, restarts and shuts down one vLLM ``AsyncLLM`` from fixed engine arguments.

    Arguments:
        engine_args: the parsed ``vllm serve`` engine arguments; every (re)build uses these.
        settings: vlguard's own options (restart budget, hold, quarantine, watchdog).
        on_failed: called once when the state becomes FAILED (the server then exits non-zero).
        state_dir: where engine cores record their fatal errors (see :mod:`server.guard.fatal`).
    """

    def __init__(
        self,
        engine_args: AsyncEngineArgs,
        settings: GuardSettings,
        on_failed: Callable[[], None] | None = None,
        state_dir: str | None = None,
    ) -> None:
        self.engine_args = engine_args
        self.settings = settings
        self.on_failed = on_failed
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="vlguard-state-")
        self.quarantine = Quarantine(settings.quarantine_deaths, settings.quarantine_size, settings.quarantine_ttl)
        self.generation = 0  # increments with every engine built
        self.state = EngineState.STOPPED
        self._engine: AsyncLLM | None = None
        self._latest: AsyncLLM | None = None
        self._serving_renderer: object | None = None
        self._pids: list[int] = []
        self._settled = asyncio.Event()
        #: One request with an earlier death on its record runs at a time (see the engine client).
        self.probation = asyncio.Lock()
        self._held = 0
        self._restarts: collections.deque[float] = collections.deque()
        self._restart_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: request id -> (fingerprint, engine generation) of every request in an engine now.
        self.inflight: dict[str, tuple[str, int]] = {}
        self.last_progress = time.monotonic()  # hang clock: last output, or when work arrived at an idle engine
        self.last_output = 0.0  # readiness: real output is as good as a probe
        self.probe_ok_at: float | None = None
        self._set_state(EngineState.STOPPED)
        m.RESTART_BUDGET.set(settings.restart_max)

    # -- state ---------------------------------------------------------------------------------------
    def _set_state(self, state: EngineState) -> None:
        self.state = state
        for s in EngineState:
            m.ENGINE_STATE.labels(state=s.value).set(1 if s is state else 0)
        m.ENGINE_UP.set(1 if state is EngineState.READY else 0)
        # Waiters wake when the state settles (READY, or FAILED/STOPPED to be refused), not while in between.
        if state in (EngineState.READY, EngineState.FAILED, EngineState.STOPPED):
            self._settled.set()
        else:
            self._settled.clear()

    @property
    def latest_engine(self) -> AsyncLLM:
        """The most recently built engine, alive or not: for static attributes (configs, renderer) that
        vLLM's serving layer may read while a replacement is being built.

        Raises:
            EngineUnavailableError: no engine was ever built.
        """
        if self._latest is None:
            raise EngineUnavailableError(f"engine is {self.state.value}", reason="not_ready")
        return self._latest

    @property
    def engine(self) -> AsyncLLM:
        """The current engine.

        Raises:
            EngineUnavailableError: no engine is READY.
        """
        if self._engine is None or self.state is not EngineState.READY:
            raise EngineUnavailableError(f"engine is {self.state.value}", reason="not_ready")
        return self._engine

    def is_ready(self) -> bool:
        """READY, and the engine answered (a probe or real output) within three probe intervals."""
        if self.state is not EngineState.READY:
            return False
        last = max(self.probe_ok_at or 0.0, self.last_output)
        return time.monotonic() - last <= 3 * self.settings.ready_probe_interval

    def healthy(self) -> bool:
        """Alive and able to recover (for liveness and the systemd watchdog)."""
        return self.state is not EngineState.FAILED

    async def acquire(self) -> tuple[AsyncLLM, int]:
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
    def _build(self) -> AsyncLLM:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.engine_args
        vllm_config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        return AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=args.enable_log_requests,
            aggregate_engine_logging=args.aggregate_engine_logging,
            disable_log_stats=args.disable_log_stats,
        )

    async def probe(self, engine: AsyncLLM) -> None:
        """Generate one token from a fixed text prompt (readiness probe).

        Raises:
            Exception: whatever the engine raised.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0)
        async for _ in engine.generate("ping", params, f"vlguard-probe-{time.monotonic_ns()}"):
            pass
        self.probe_ok_at = time.monotonic()

    async def _bring_up(self) -> None:
        engine = await asyncio.wait_for(asyncio.to_thread(self._build), self.settings.startup_timeout)
        try:
            await engine.reset_mm_cache()  # drop the profiling run's dummy images
            await asyncio.wait_for(self.probe(engine), self.settings.startup_timeout)
        except BaseException:
            await asyncio.to_thread(engine.shutdown)
            raise
        self._engine = self._latest = engine
        if self._serving_renderer is None:
            self._serving_renderer = engine.renderer
        self._pids = watchdog.engine_core_pids(engine)
        self.generation += 1
        self.last_progress = self.last_output = time.monotonic()
        if self.generation > 1:  # a restart: freeze the new engine's objects, as the app does at start-up
            from vllm.utils.gc_utils import freeze_gc_heap

            freeze_gc_heap()
        self._set_state(EngineState.READY)

    async def start(self) -> None:
        """Build the first engine and start watching it.

        Raises:
            Exception: whatever vLLM raised while building (state becomes FAILED).
        """
        self._set_state(EngineState.STARTING)
        started = time.monotonic()
        try:
            await self._bring_up()
        except BaseException:
            self._set_state(EngineState.FAILED)
            raise
        logger.info("engine ready in %.1f s (generation %d)", time.monotonic() - started, self.generation)
        self._tasks.append(asyncio.create_task(self._watch_forever(), name="vlguard-watchdog"))

    # -- death and restart ---------------------------------------------------------------------------
    def report_death(self, generation: int, cause: DeathCause | None = None) -> None:
        """Declare engine ``generation`` dead (idempotent) and start the restart.

        Arguments:
            generation: the engine generation the caller saw die; stale reports are ignored.
            cause: known cause (watchdog); None to classify from what the engine core recorded.
        """
        if generation != self.generation or self.state is not EngineState.READY:
            return
        if cause is None:
            cause = watchdog.classify(read_fatal(self.state_dir, self._pids), self._pids)
        self._set_state(EngineState.DEAD)
        m.ENGINE_DEATHS.labels(cause=cause.value).inc()
        victims = [fp for fp, gen in self.inflight.values() if gen == generation]
        for fp in self.quarantine.record_death(victims):
            logger.error("request %s quarantined: in flight at %d engine deaths", fp, self.quarantine.deaths)
        logger.error(
            "engine generation %d died (cause: %s) with %d request(s) in flight; restarting in-process",
            generation, cause.value, len(victims),
        )  # fmt: skip
        self._restart_task = asyncio.create_task(self._restart(), name="vlguard-restart")

    async def _teardown(self) -> None:
        engine, self._engine = self._engine, None
        pids, self._pids = self._pids, []
        killed = await asyncio.to_thread(watchdog.kill_tree, pids)  # a stopped or hung core cannot exit cleanly
        if engine is not None:
            # vLLM's serving classes keep the first engine's renderer (tokenizer, chat template, multimodal
            # processor: API-side only, no engine-core state with the processor cache off). AsyncLLM's
            # shutdown(), which its __del__ also runs, would stop that renderer's executors under them.
            if engine.renderer is self._serving_renderer:
                engine.renderer = None  # type: ignore[assignment]  # detach; AsyncLLM.shutdown skips None
            if (handler := getattr(engine, "output_handler", None)) is not None:
                handler.cancel()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(engine.engine_core.shutdown)
        for pid in killed:
            mark_process_dead(pid)

    async def _restart(self) -> None:
        died_at = time.monotonic()
        await self._teardown()
        gc.unfreeze()  # the dead engine's objects were frozen with the startup heap: let the collector have them
        self._set_state(EngineState.RESTARTING)
        failures = 0
        while True:
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self.settings.restart_window:
                self._restarts.popleft()
            if len(self._restarts) >= self.settings.restart_max:
                logger.critical(
                    "restart budget spent (%d in %.0f s): giving up, exiting non-zero",
                    len(self._restarts), self.settings.restart_window,
                )  # fmt: skip
                self._fail()
                return
            self._restarts.append(now)
            try:
                await self._bring_up()
            except Exception:
                failures += 1
                m.ENGINE_RESTARTS.labels(outcome="failure").inc()
                logger.exception("engine restart attempt failed (%d)", failures)
                await asyncio.sleep(self.settings.restart_backoff * 2 ** (failures - 1))  # exponential backoff
                continue
            m.ENGINE_RESTARTS.labels(outcome="success").inc()
            m.RESTART_DURATION.observe(time.monotonic() - died_at)
            logger.info("engine restarted in %.1f s (generation %d)", time.monotonic() - died_at, self.generation)
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
        engine, generation = self._engine, self.generation
        problem = watchdog.process_problem(self._pids)
        if problem is None and engine.errored:
            problem = watchdog.classify(read_fatal(self.state_dir, self._pids), self._pids)
        if problem is None and self.inflight and time.monotonic() - self.last_progress > self.settings.hang_timeout:
            problem = DeathCause.HANG
        if problem is not None:
            self.report_death(generation, problem)
            return
        idle = not self.inflight
        probe_due = time.monotonic() - (self.probe_ok_at or 0.0) > self.settings.ready_probe_interval
        if idle and probe_due:
            try:
                await asyncio.wait_for(self.probe(engine), self.settings.hang_timeout)
            except Exception:
                if self.generation == generation:
                    self.report_death(generation, DeathCause.HANG if not engine.errored else None)

    def note_progress(self, output: bool = True) -> None:
        """Restart the hang clock: the engine produced output, or (``output=False``) work arrived at an idle
        engine. Called by the engine client."""
        self.last_progress = time.monotonic()
        if output:
            self.last_output = self.last_progress

    # -- lifetime ------------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Stop watching and shut the engine down (engine-core and worker processes exit). Idempotent."""
        for task in [*self._tasks, self._restart_task]:
            if task is not None:
                task.cancel()
        self._tasks.clear()
        engine, self._engine, self._latest = self._engine, None, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        if self.state is not EngineState.FAILED:
            self._set_state(EngineState.STOPPED)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Supervisor]:
        """Start the engine for the duration of the block; always shut it down afterwards."""
        try:
            await self.start()
            yield self
        finally:
            await self.shutdown()
