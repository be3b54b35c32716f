"""Bringing engines up and down (API process): the steps of one build, a build left unfinished at shutdown,
a dead engine's teardown, and the spare engine process kept for the next build.

The supervisor (:mod:`server.guard.supervisor`) decides *when*; this module is *how*, with the primitives
of :mod:`server.guard.lifecycle` and the hooks of :mod:`server.vllm_hooks.async_llm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server import shm
from server.engine.protocol import EngineSettings, engine_dir
from server.guard import ipc_cache, output_faults, watchdog
from server.guard.hold import HoldPolicy, RebuildPath
from server.guard.ipc_cache import EngineCacheShadow
from server.guard.lifecycle import Engine, EngineFactory, Placement, ServingRenderer, in_daemon_thread, teardown
from server.guard.load import EngineLoad
from server.guard.spare import Spares, publish
from server.metrics import definitions as m
from server.settings import GuardSettings
from server.vllm_hooks import async_llm

if TYPE_CHECKING:
    import psutil

logger = logging.getLogger("server.guard.supervisor")

#: The readiness probe's prompt (token ids; any valid id does: one token is generated from it).
PROBE_PROMPT_IDS = (0,)
PROBE_ID_PREFIX = "vlguard-probe-"


def is_probe(request_id: str) -> bool:
    """Whether ``request_id`` (vLLM's, which may carry a suffix) is one of :func:`probe`'s."""
    return request_id.startswith(PROBE_ID_PREFIX)


async def probe(engine: Engine) -> None:
    """Generate one token from a fixed one-token prompt (readiness probe).

    The prompt is given as token ids: a text prompt is tokenized on the event loop's thread with the
    tokenizer vLLM's request tokenizer uses in its own thread, and the Rust tokenizer refuses concurrent
    use ("RuntimeError: Already borrowed": a request got a 500 under load when a probe ran beside it).

    Counted as ``vlguard_engine_probes``, never in vLLM's client series (:meth:`EngineBuilder.build` keeps
    them out).

    Raises:
        Exception: whatever the engine raised.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    prompt = {"prompt_token_ids": list(PROBE_PROMPT_IDS)}
    try:
        async for _ in engine.generate(prompt, params, f"{PROBE_ID_PREFIX}{time.monotonic_ns()}"):
            pass
    except BaseException:
        m.ENGINE_PROBES.labels(result="failed").inc()
        raise
    m.ENGINE_PROBES.labels(result="ok").inc()


@dataclass
class BuiltEngine:
    """An engine that answered its first probe, with what its teardown and its watch need.

    Attributes:
        generation: 1 for the first engine, one more for each rebuild.
        pids: its engine-core processes; ``tree`` those and their descendants (the workers) when it was built.
        ipc_cache: what its engine core holds of the processed images sent to it (None: strip nothing).
    """

    engine: Engine
    generation: int
    pids: list[int] = field(default_factory=list)
    tree: list[psutil.Process] = field(default_factory=list)
    ipc_cache: EngineCacheShadow | None = None


class EngineBuilder:
    """Builds engines one at a time, always the same way, and takes them down.

    Arguments:
        engine_factory: builds a new engine (blocking; run in a daemon thread of its own).
        settings: ``startup_timeout`` (one build), soft recovery's settings for the engine core.
        state_dir: below it, each engine's directory for its engine core's records.
        spares: keeps a spare engine process for rebuilds (:mod:`server.guard.spare`); None: every build
            spawns its processes.
        reap_children: at shutdown, end every process below this one (see :meth:`shut_down`); and when a
            rebuild takes longer than its bound, the processes it started (the next rebuild's spare kept).
        limits: bounds each build (:meth:`HoldPolicy.build_limit`); None: ``startup_timeout`` each.
    """

    def __init__(
        self,
        engine_factory: EngineFactory,
        settings: GuardSettings,
        state_dir: str,
        spares: Spares | None = None,
        reap_children: bool = False,
        limits: HoldPolicy | None = None,
    ) -> None:
        self.engine_factory, self.settings, self.state_dir = engine_factory, settings, state_dir
        self.load = EngineLoad()  # measures each engine built (admission's input: server.guard.load)
        self.spares, self.reap_children = spares, reap_children
        self.limits = limits or HoldPolicy.from_settings(settings)
        self.renderer = ServingRenderer()
        self._building: asyncio.Future[Engine] | None = None  # an engine build running in a thread
        self._segments: set[str] = set()  # shared memory of engines built (server.shm), released once gone
        #: True when shutdown had to leave a build behind in its daemon thread (it does not hold the exit).
        self.abandoned_build = False
        #: The path the latest build took (None: the first start).
        self.building_path: RebuildPath | None = None
        #: generation -> its engine core's record directory, where another process launched it (Placement)
        self._placed: dict[int, Path] = {}
        if spares is None:
            publish(RebuildPath.COLD)

    def rebuild_path(self) -> RebuildPath:
        """The path a rebuild would take now (:meth:`SpareKeeper.path`)."""
        return self.spares.path() if self.spares is not None else RebuildPath.COLD

    def engine_dir(self, generation: int) -> Path:
        """Where engine ``generation``'s engine core writes its records (:mod:`server.engine.protocol`)."""
        return self._placed.get(generation) or engine_dir(self.state_dir, generation)

    async def bring_up(self, generation: int, on_step: Callable[[], None]) -> BuiltEngine:
        """Build engine ``generation``, drop its profiling run's images, probe it, and hook it.

        Arguments:
            on_step: called each time the API process receives a step's outputs from its engine core.

        Raises:
            TimeoutError: the build or the probe took longer than ``startup_timeout`` seconds.
            Exception: whatever vLLM raised (a built engine that failed its probe is shut down).
        """
        directory = self.engine_dir(generation)
        directory.mkdir(parents=True, exist_ok=True)
        # Inherited by the engine-core process this build spawns (server.engine.fatal, server.engine.soft).
        s = self.settings
        EngineSettings(str(directory), s.soft_recovery, s.soft_recovery_max, s.restart_window).apply()
        engine = await self._build(rebuild=generation > 1)
        if (placement := Placement.of(engine)) is not None:  # another process launched it
            self._placed = {generation: Path(placement.directory)}
        if (processor := async_llm.output_processor_of(engine)) is not None:
            async_llm.keep_out_of_client_stats(processor, is_probe)  # before its first probe
        try:
            await engine.reset_mm_cache()  # drop the profiling run's dummy images
            self.renderer.adopt(engine)
            await asyncio.wait_for(probe(engine), s.startup_timeout)
        except BaseException:
            self.renderer.release(engine)
            await asyncio.to_thread(engine.shutdown)
            raise
        async_llm.on_engine_core_output(engine, on_step)
        if (processor := async_llm.output_processor_of(engine)) is not None:
            output_faults.confine(processor)  # a request whose output processing raises costs only itself
            self.load.attach(processor, async_llm.max_num_seqs(engine))
        self.renderer.keep(engine)
        pids = async_llm.engine_core_pids(engine)
        # workers too: orphaned once their engine core dies
        built = BuiltEngine(engine, generation, pids, watchdog.process_tree(pids), ipc_cache.shadow_for(engine))
        await self._note_segments(built, directory)
        if generation > 1:  # a restart: freeze the new engine's objects, as the app does at start-up
            from vllm.utils.gc_utils import freeze_gc_heap

            freeze_gc_heap()
        return built

    async def _build(self, rebuild: bool) -> Engine:
        spares = self.spares.pids if self.spares is not None else set  # the spare of the next rebuild
        # not this build's: taken before the spare is armed (then it is this build's engine core)
        others = await asyncio.to_thread(lambda: watchdog.descendant_pids() - spares())
        if rebuild:  # its engine core runs in the spare, its worker in the spare's (the keeper may be busy)
            self.building_path = await asyncio.to_thread(self.spares.arm) if self.spares else RebuildPath.COLD
        building = self._building = in_daemon_thread(self.engine_factory)
        limit = self.limits.build_limit(rebuild)
        try:
            # shield: a cancelled wait (shutdown) leaves the build to shut_down(), which ends it
            return await asyncio.wait_for(asyncio.shield(building), limit)
        except TimeoutError:
            if rebuild:  # stuck (a stopped or hung process): end the processes it started (its spare's too)
                logger.error("engine rebuild not done within %.0f s: abandoning it", limit)
                await self._end_build(self.settings.shutdown_timeout, others | spares())
            raise
        finally:
            if building.done():
                self._building = None
            if self.spares is not None:
                self.spares.after_build()

    async def replenish_spare(self, engine: Engine) -> None:
        """Start the spare engine process for the next rebuild, from ``engine``'s config. Never raises."""
        if self.spares is None or (config := getattr(engine, "vllm_config", None)) is None:
            return
        try:
            await asyncio.to_thread(self.spares.replenish, config)  # spawning pickles the config: blocks
        except Exception:  # the engine serves without a spare; the next rebuild spawns
            logger.exception("spare engine process not started")

    async def check_spare(self) -> None:
        """Replace a spare engine process that died. Never raises."""
        if self.spares is None:
            return
        try:
            await asyncio.to_thread(self.spares.check)
        except Exception:
            logger.exception("spare engine process not replaced")

    async def teardown(self, built: BuiltEngine | None) -> None:
        """End a dead engine (:func:`server.guard.lifecycle.teardown`). Never raises."""
        if built is not None:
            await self._note_segments(built, self.engine_dir(built.generation))  # made since its build
            await teardown(built.engine, built.pids, built.tree, self.renderer)
            await asyncio.to_thread(self._release_segments)

    async def close_spare(self) -> None:
        """End the spare engine process (at shutdown, before the engine)."""
        if self.spares is not None:
            await asyncio.to_thread(self.spares.close)

    async def shut_down(self, engine: Engine | None) -> None:
        """Shut ``engine`` and an unfinished build down; with ``reap_children``, every process below this one
        but multiprocessing's resource tracker (SIGTERM, then SIGKILL). Each stage is bounded by
        ``shutdown_timeout`` seconds. Never raises."""
        bound = self.settings.shutdown_timeout
        if engine is not None:
            self.renderer.shutdown_own(engine)
            try:
                await asyncio.wait_for(asyncio.to_thread(engine.shutdown), bound)
            except Exception:
                logger.exception("engine shutdown did not complete cleanly")
        await self._end_build(bound)
        if self.reap_children:
            await self._end_descendants(bound)

    async def _end_descendants(self, grace_s: float, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """:func:`server.guard.watchdog.end_descendants`, and the shared memory those processes mapped released."""
        self._segments |= await asyncio.to_thread(lambda: shm.mapped(watchdog.descendant_pids() - set(keep)))
        await asyncio.to_thread(watchdog.end_descendants, grace_s, keep)
        await asyncio.to_thread(self._release_segments)

    async def _note_segments(self, built: BuiltEngine, directory: Path) -> None:
        """Note (and record in ``directory``) the shared memory ``built``'s processes map now."""
        found = await asyncio.to_thread(shm.mapped, [*built.pids, *(p.pid for p in built.tree)])
        found -= self._segments
        self._segments |= found
        shm.record(directory, found)

    def _release_segments(self) -> None:
        """Unlink the noted shared memory no process of this server maps any more (its engines are gone)."""
        gone = self._segments - shm.mapped([os.getpid(), *watchdog.descendant_pids()])
        if released := shm.release(gone):
            logger.info("released %d shared-memory segment(s) of engines that are gone", len(released))
        self._segments -= gone

    async def _end_build(self, bound_s: float, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """End an engine build still running in its thread: kill what it spawned (with ``reap_children``;
        the processes in ``keep`` excepted) until it gives up, then shut down whatever it built. Gives up
        after ``bound_s`` seconds."""
        building, self._building = self._building, None
        if building is None:
            return
        loop = asyncio.get_running_loop()  # wall-clock bound: the injectable clock is for the engine's timers
        deadline = loop.time() + bound_s
        while not building.done() and loop.time() < deadline:
            if self.reap_children:
                await self._end_descendants(0.0, keep)  # its handshake with the engine then fails
            await asyncio.wait({building}, timeout=0.5)
        if not building.done():
            logger.error("an engine build did not end within %.0f s of being abandoned; leaving it", bound_s)
            self.abandoned_build = True
            return
        if not building.cancelled() and building.exception() is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(building.result().shutdown), bound_s)


__all__ = ["PROBE_PROMPT_IDS", "BuiltEngine", "EngineBuilder", "probe"]
