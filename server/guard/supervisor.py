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
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.guard import fatal, ipc_cache, output_faults, watchdog
from server.guard.clients import ClientBudget
from server.guard.errors import EngineUnavailableError
from server.guard.fatal import FatalRecord, read_fatal
from server.guard.inflight import InflightLedger
from server.guard.ipc_cache import EngineCacheShadow
from server.guard.quarantine import Quarantine
from server.guard.soft import ENABLED_ENV as SOFT_ENABLED_ENV
from server.guard.soft import MAX_ENV as SOFT_MAX_ENV
from server.guard.soft import WINDOW_ENV as SOFT_WINDOW_ENV
from server.guard.soft import SoftFault, read_soft_faults
from server.guard.spare import SpareKeeper
from server.guard.watchdog import DeathCause
from server.metrics import definitions as m
from server.metrics.registry import mark_process_dead
from server.settings import GuardSettings

if TYPE_CHECKING:
    import psutil
    from vllm.engine.arg_utils import AsyncEngineArgs

logger = logging.getLogger(__name__)

#: The engine the supervisor runs: vLLM's ``AsyncLLM``, or a test's fake with the same surface
#: (``generate``, ``abort``, ``errored``, ``reset_mm_cache``, ``shutdown``, ``renderer``).
Engine = Any
EngineFactory = Callable[[], Engine]

__all__ = ["Engine", "EngineFactory", "EngineState", "EngineUnavailableError", "Supervisor", "build_async_llm"]


def build_async_llm(engine_args: AsyncEngineArgs) -> Engine:
    """A new vLLM ``AsyncLLM`` from ``engine_args`` (blocks for the whole model load; run it off the loop)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
    )


#: The readiness probe's prompt (token ids; any valid id does: one token is generated from it).
PROBE_PROMPT_IDS = (0,)

_CHILD_PREFIX = re.compile(r"^\d+_")  # vLLM's ids of an n > 1 request's samples: "<index>_<request id>"


def charged_requests(inflight: dict[str, str], record: FatalRecord | SoftFault | None) -> list[str]:
    """The in-flight request ids a fault is charged to: those in the step the engine core recorded as
    failing. vLLM's engine-side ids are ``<request id>-<8 hex>``, and ``<index>_<request id>-<8 hex>`` for
    the samples of an ``n > 1`` request.

    Arguments:
        inflight: request id -> fingerprint of the requests inside the dead engine.
        record: what its engine core recorded (before dying, or when it absorbed the fault), or None.

    Returns:
        Sorted request ids; empty without a record (a SIGKILL, segfault or OOM kill of the engine core, or
        a hang, says nothing about the requests in flight).
    """
    if record is None or not record.step_requests:
        return []
    return sorted(rid for rid in inflight if rid in api_ids(record.step_requests))


def api_ids(engine_ids: list[str]) -> set[str]:
    """Every id an API-side request may go by for these engine-side ids (the id itself, without its
    suffix, and without an ``n > 1`` sample's prefix)."""
    ids = set()
    for engine_id in engine_ids:
        base = engine_id.rsplit("-", 1)[0]
        ids |= {engine_id, base, _CHILD_PREFIX.sub("", base)}
    return ids


def _in_daemon_thread(fn: Callable[[], Engine]) -> asyncio.Future[Engine]:
    """Run ``fn`` (an engine build) in a daemon thread of its own; its result or exception lands in the
    returned future. Not the loop's default executor: ``asyncio.run`` waits for those threads at exit, so
    a build that never returns would hold the process forever."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Engine] = loop.create_future()

    def settle(result: Engine, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: the process is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="vlguard-engine-build", daemon=True).start()
    return future


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
        state_dir: where engine cores record their fatal errors (see :mod:`server.guard.fatal`); by
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
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="vlguard-state-")
        self.clock = clock
        self._sleep = sleep
        self.quarantine = Quarantine(
            settings.quarantine_deaths, settings.quarantine_size, settings.quarantine_ttl, clock=clock
        )
        #: per-client fault budget (:mod:`server.guard.clients`)
        self.clients = ClientBudget(
            settings.client_fault_max, settings.restart_window, settings.client_cooldown, clock=clock
        )
        #: fingerprints to run on probation without a strike: in the engine when a fault named no request
        self.suspects: set[str] = set()
        self.generation = 0  # increments with every engine built
        self.state = EngineState.STOPPED
        self._engine: Engine | None = None
        self._latest: Engine | None = None
        self._serving_renderer: object | None = None
        self._pids: list[int] = []
        self._tree: list[psutil.Process] = []
        self._settled = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) at every state change
        self._held = 0
        self._restarts: collections.deque[float] = collections.deque()
        self._restart_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._building: asyncio.Future[Engine] | None = None  # an engine build running in a thread
        self._stop_requested = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: True when shutdown had to leave a build behind in its daemon thread (it does not hold the exit).
        self.abandoned_build = False
        #: Requests inside an engine now, and the probation slot for suspects.
        self.inflight = InflightLedger(settings.hold_timeout, settings.probation_drain_timeout)
        self.last_progress = clock()  # hang clock: last output, or when work arrived at an idle engine
        self.last_output = 0.0  # readiness: real output is as good as a probe
        self.probe_ok_at: float | None = None
        self._soft_read: set[str] = set()  # soft-fault records of the current engine already counted
        self._soft_cut: set[str] = set()  # API-side ids of the requests they cut
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
        """Where engine ``generation``'s engine core records its fatal error (:mod:`server.guard.fatal`)."""
        return Path(self.state_dir) / f"engine-{generation}"

    async def _bring_up(self) -> None:
        fatal_dir = self.engine_dir(self.generation + 1)
        fatal_dir.mkdir(parents=True, exist_ok=True)
        # Inherited by the engine-core process this build spawns (server.guard.fatal, server.guard.soft).
        os.environ[fatal.ENV] = str(fatal_dir)
        os.environ[SOFT_ENABLED_ENV] = "on" if self.settings.soft_recovery else "off"
        os.environ[SOFT_MAX_ENV] = str(self.settings.soft_recovery_max)
        os.environ[SOFT_WINDOW_ENV] = str(self.settings.restart_window)
        if self.spares is not None and self.generation:
            self.spares.arm()  # a rebuild: its engine core runs in the spare, its worker in the spare's
        building = self._building = _in_daemon_thread(self.engine_factory)
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
            self._adopt_serving_renderer(engine)
            await asyncio.wait_for(self.probe(engine), self.settings.startup_timeout)
        except BaseException:
            self._release_renderers(engine)
            await asyncio.to_thread(engine.shutdown)
            raise
        generation = self.generation + 1
        watchdog.on_engine_core_output(engine, lambda: self._note_engine_step(generation))
        if (processor := getattr(engine, "output_processor", None)) is not None:
            output_faults.confine(processor)  # a request whose output processing raises costs only itself
        self._engine = self._latest = engine
        self._ipc_cache = ipc_cache.shadow_for(engine)
        if self._serving_renderer is None:
            self._serving_renderer = engine.renderer
        self._pids = watchdog.engine_core_pids(engine)
        self._tree = watchdog.process_tree(self._pids)  # workers too: orphaned once their engine core dies
        self._soft_read, self._soft_cut = set(), set()
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

    def _adopt_serving_renderer(self, engine: Any) -> None:
        """vLLM's serving classes render every request with the first engine's renderer (tokenizer, chat
        template, multimodal processor and its processor cache); a rebuilt engine's output handler, started
        by its first request, reports the cache statistics of ``engine.renderer`` (``vllm:mm_cache_*``):
        point that at the renderer in use. The engine's own renderer stays with its input processor and is
        shut down with the engine (:meth:`_release_renderers`)."""
        if self._serving_renderer is not None:
            engine.renderer = self._serving_renderer

    def _release_renderers(self, engine: Any) -> None:
        """Before ``engine`` is shut down: detach the serving renderer (``AsyncLLM.shutdown``, which its
        ``__del__`` also runs, would stop its executors under the serving classes) and shut down the
        engine's own renderer, if it has one besides."""
        serving = self._serving_renderer
        if engine.renderer is serving:
            engine.renderer = None  # AsyncLLM.shutdown skips None
        self._shutdown_own_renderer(engine)

    def _shutdown_own_renderer(self, engine: Any) -> None:
        """Shut down the renderer ``engine`` built for itself when it serves with another (a rebuilt
        engine: :meth:`_adopt_serving_renderer`); ``AsyncLLM.shutdown`` only stops ``engine.renderer``."""
        own = getattr(getattr(engine, "input_processor", None), "renderer", None)
        if own is not None and own is not self._serving_renderer and own is not engine.renderer:
            with contextlib.suppress(Exception):
                own.shutdown()

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
        self._charge(inflight, charged, record)
        logger.error(
            "engine generation %d died (cause: %s) with %d request(s) in flight; %s; restarting in-process",
            generation, cause.value, len(inflight),
            f"charged to the {len(charged)} request(s) of the failing step: "
            + ", ".join(sorted({inflight[r] for r in charged}))
            if charged else "no request charged (no step raised: a kill, crash or hang is no evidence against one)",
        )  # fmt: skip
        # A fault charged to one request (named, or alone in its step) is its own: its strikes and its
        # client's budget, not the restart budget. A whole step's, a kill, a crash or a hang spend it.
        self._restart_task = asyncio.create_task(self._restart(counted=len(charged) != 1), name="vlguard-restart")

    def _charge(self, inflight: dict[str, str], charged: list[str], record: FatalRecord | SoftFault | None) -> None:
        """Give each charged request (id -> fingerprint in ``inflight``) a strike; charge its client's fault
        budget when the fault named that request alone; put a fault's suspects (it named nobody) on
        probation."""
        evidence = "named" if record is not None and record.named else "step_exception"
        if charged:
            m.QUARANTINE_STRIKES.labels(evidence=evidence).inc(len(charged))
        for fp in self.quarantine.record_death(inflight[rid] for rid in charged):
            logger.error("request %s quarantined: charged with %d engine faults", fp, self.quarantine.deaths)
        m.QUARANTINED.set(self.quarantine.quarantined_count())
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

    def is_suspect(self, fp: str) -> bool:
        """Whether ``fp`` runs on probation: it has a strike, or was in the engine at a fault that named no
        request (until it completes once)."""
        return fp in self.suspects or self.quarantine.strikes(fp) > 0

    def cleared(self, fp: str) -> None:
        """``fp`` ran to its end on probation: no longer a suspect (its strikes stay)."""
        self.suspects.discard(fp)

    def absorb_soft_faults(self, generation: int) -> None:
        """Count the faults engine ``generation`` absorbed since the last call (soft recovery,
        :mod:`server.guard.soft`): metrics, quarantine strikes for the requests of each failing step, a log
        line each; remember the requests each one cut. Called by the engine client when a request ends in
        an ``ERROR`` finish, and by the watchdog. Stale generations are ignored."""
        if generation != self.generation:
            return
        for name, record in read_soft_faults(self.engine_dir(generation), skip=self._soft_read):
            self._soft_read.add(name)
            self._soft_cut |= api_ids(record.cut)
            cause = watchdog.exception_cause(record.describe())
            m.ENGINE_DEATHS.labels(cause=cause.value).inc()
            m.ENGINE_RECOVERIES.labels(kind="soft").inc()
            m.RECOVERY_DURATION.labels(kind="soft").observe(record.recovery_s)
            inflight = self.inflight.requests(generation)
            charged = charged_requests(inflight, record)
            self._charge(inflight, charged, record)
            logger.error(
                "engine generation %d: step fault (cause: %s) absorbed in %.3f s; %d request(s) cut and carried "
                "over; %s: %s",
                generation, cause.value, record.recovery_s, len(record.cut),
                f"charged to the {len(charged)} request(s) of the failing step: "
                + ", ".join(sorted({inflight[r] for r in charged}))
                if charged else "no request charged", record.describe()[:500],
            )  # fmt: skip

    def output_fault(self, generation: int, request_id: str, fault: BaseException) -> None:
        """Processing ``request_id``'s output raised in this process (:mod:`server.guard.output_faults`): a
        fault named to that request, absorbed without touching the engine (counted as a soft recovery)."""
        if generation != self.generation:
            return
        inflight = self.inflight.requests(generation)
        record = SoftFault(type(fault.__cause__ or fault).__name__, str(fault)[:2000], [request_id], [],
                           [request_id], 0.0, named=True)  # fmt: skip
        m.ENGINE_DEATHS.labels(cause=watchdog.exception_cause(record.describe()).value).inc()
        m.ENGINE_RECOVERIES.labels(kind="soft").inc()
        m.RECOVERY_DURATION.labels(kind="soft").observe(0.0)
        self._charge(inflight, [request_id] if request_id in inflight else [], record)
        logger.error(
            "engine generation %d: processing the output of request %s (%s) failed; charged to it and carried "
            "over: %s", generation, request_id, inflight.get(request_id), record.describe()[:300],
        )  # fmt: skip

    def ipc_cache(self, generation: int) -> EngineCacheShadow | None:
        """What engine ``generation``'s engine core holds of the processed images sent to it (None: strip
        nothing; a stale generation, or an engine core without a receiver cache)."""
        return self._ipc_cache if generation == self.generation else None

    def take_cut(self, generation: int, request_id: str) -> bool:
        """Whether a soft recovery of engine ``generation`` cut ``request_id`` (it is then carried over; the
        answer is given once per cut, so a later ``ERROR`` finish of the same id is vLLM's own)."""
        self.absorb_soft_faults(generation)
        if generation != self.generation or request_id not in self._soft_cut:
            return False
        self._soft_cut.discard(request_id)
        return True

    async def _teardown(self) -> None:
        engine, self._engine = self._engine, None
        pids, self._pids, tree, self._tree = self._pids, [], self._tree, []
        # A stopped or hung core cannot exit cleanly; the workers of a killed one are orphans by now.
        killed = await asyncio.to_thread(watchdog.kill_tree, pids, tree)
        if engine is not None:
            self._release_renderers(engine)
            if (handler := getattr(engine, "output_handler", None)) is not None:
                handler.cancel()
            if (core := getattr(engine, "engine_core", None)) is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(core.shutdown)
        for pid in killed:
            mark_process_dead(pid)

    async def _restart(self, counted: bool = True) -> None:
        """Tear the dead engine down and build a new one, within the restart budget (``counted``: whether
        this death spends it; a fault charged to requests does not)."""
        died_at = self.clock()
        await self._teardown()
        gc.unfreeze()  # the dead engine's objects were frozen with the startup heap: let the collector have them
        self._set_state(EngineState.RESTARTING)
        failures = 0
        while True:
            now = self.clock()
            while self._restarts and now - self._restarts[0] > self.settings.restart_window:
                self._restarts.popleft()
            if len(self._restarts) >= self.settings.restart_max:
                logger.critical(
                    "restart budget spent (%d in %.0f s): giving up, exiting non-zero",
                    len(self._restarts), self.settings.restart_window,
                )  # fmt: skip
                self._fail()
                return
            if counted or failures:  # a failed attempt always counts: the engine, not a request, is at fault
                self._restarts.append(now)
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
        output kind; see :func:`watchdog.on_engine_core_output`)."""
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
            self._shutdown_own_renderer(engine)
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
