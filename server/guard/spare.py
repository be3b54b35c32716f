"""Keeping a spare engine process ready for the next rebuild (API process; the spare itself and the
hand-over are :mod:`server.engine.spare`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from server.engine.spare import CORE_MODULES, CORE_PROCESS, Spare, arm, disarm, env_differences, install
from server.guard import watchdog
from server.guard.hold import RebuildPath
from server.vllm_hooks import processes

logger = logging.getLogger("vllm.vlguard.spare")


def publish(path: RebuildPath) -> None:
    """Set ``vlguard_engine_rebuild_path{path}`` (one-hot) and ``vlguard_engine_spare_up``."""
    from server.metrics import definitions as m

    m.SPARE_UP.set(1 if path is RebuildPath.SPARE else 0)
    for each in RebuildPath:
        m.REBUILD_PATH.labels(path=each.value).set(1 if each is path else 0)


class Spares(Protocol):
    """What an engine build needs of the spare engine processes (:class:`SpareKeeper` here; with several API
    processes, :class:`server.scaleout.remote.OwnersSpare`: the owner keeps the spare)."""

    def path(self) -> RebuildPath: ...
    def pids(self) -> set[int]: ...
    def arm(self) -> RebuildPath: ...
    def after_build(self) -> None: ...
    def replenish(self, vllm_config: object) -> None: ...
    def check(self) -> None: ...
    def close(self) -> None: ...


class SpareKeeper:
    """Keeps one engine-core spare (with its worker spare) ready for the next rebuild of the engine.

    Each engine build calls :meth:`on_config` as soon as its configuration is made, before vLLM starts its processes
    (where that does not slow the build, the spare then imports beside it), the supervisor :meth:`replenish` once
    the engine is READY (the spare is spawned for that engine's
    configuration if none is alive), :meth:`check` on every watchdog tick (a dead spare is counted and replaced,
    after a back-off that doubles with each death in a row: a spare killed while importing, by a memory limit say,
    must not be respawned every tick), :meth:`arm` before a rebuild and :meth:`after_build` after it, and
    :meth:`close` at shutdown. ``vlguard_engine_spare_up`` is 1 while a spare and its worker spare are ready;
    ``vlguard_engine_spare_events_total{event}`` counts spawned, died, used and refused spares;
    ``vlguard_engine_rebuild_path{path}`` is 1 for the path a rebuild would take now (:meth:`path`). Spawning blocks
    (the configuration is pickled to the child): call it off the event loop.

    Arguments:
        modules: what the engine core's spare imports.
        backoff_s: wait before replacing a spare after its first death in a row (then 2x, 4x..., at most
            ``max_backoff_s``).
        clock: monotonic seconds.
        parallel_cpus: with this many CPUs or more, a spare is spawned beside every build (:meth:`on_config`).
    """

    def __init__(
        self,
        modules: Iterable[str] = CORE_MODULES,
        backoff_s: float = 10.0,
        max_backoff_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        parallel_cpus: int = 4,
    ) -> None:
        self.modules, self.parallel_cpus = tuple(modules), parallel_cpus
        self.backoff_s, self.max_backoff_s, self.clock = backoff_s, max_backoff_s, clock
        self.spare: Spare | None = None  # the next rebuild's
        self._armed: Spare | None = None  # the build in progress's (handed over, or given back after it)
        self._armed_ready = False  # and it was ready when armed
        self._config: object | None = None
        self._wanted = False  # replenish() was called and close() was not
        self._closed = False
        self._deaths_in_a_row = 0
        self._not_before = 0.0  # no replacement before this time (back-off)
        self._fork_noted = False
        self._ready = False  # the spare said it is ready (read by check(), under the lock)
        self._lock = threading.RLock()  # the watchdog's check (a thread) vs a rebuild's arm (the loop)

    def on_config(self, vllm_config: object) -> None:
        """An engine build has its configuration (:func:`server.guard.lifecycle.build_async_llm`): spawn
        the spare now, in a thread of its own (the build goes on meanwhile), when its imports do not slow
        the build down: the build was armed with a ready spare (the rebuild is seconds; the next death then
        finds a spare already importing), or the machine has ``parallel_cpus`` or more CPUs (the first
        start's or a cold rebuild's imports run beside the spare's). Otherwise the spare is spawned once the
        engine is READY (:meth:`replenish`): on two cores the first start took 55 s instead of 33 s with
        the spare beside it, and a rebuild through a spare still importing 38 s instead of 23 s."""
        with self._lock:
            armed_ready, self._armed_ready = self._armed_ready, False
        if not armed_ready and (os.cpu_count() or 1) < self.parallel_cpus:
            return

        def spawn() -> None:
            try:
                self.replenish(vllm_config)
            except Exception:  # the engine serves without a spare; the next READY spawns
                logger.exception("spare engine process not started")

        threading.Thread(target=spawn, name="vlguard-spare-spawn", daemon=True).start()

    def replenish(self, vllm_config: object) -> None:
        """Spawn a spare for an engine configured like ``vllm_config`` unless a live one exists, the
        back-off after a death has not passed, vLLM forks here, or the keeper is closed."""
        from server.metrics import definitions as m

        with self._lock:
            if self._closed:
                return
            self._config, self._wanted = vllm_config, True
            if self.spare is not None and self.spare.alive():
                return
            if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
                # vLLM forks (its default where nothing forces spawn, e.g. CUDA before the API process
                # touches the GPU): a forked engine core inherits this process's imports, nothing to save.
                if not self._fork_noted:
                    logger.info("no spare engine process: vLLM forks its engine processes here")
                    self._fork_noted = True
                return
            if self.clock() < self._not_before:
                return
            self.spare, self._ready = Spare(self.modules, worker_spare_for=vllm_config), False
            self._publish()
        m.SPARE_EVENTS.labels(event="spawned").inc()
        logger.info("spare engine process %s started", self.spare.pid)

    def _settle_death(self) -> None:
        """Count and drop a spare that died while waiting; start the back-off."""
        from server.metrics import definitions as m

        spare = self.spare
        if spare is None or spare.state != "waiting" or spare.proc.is_alive():
            return
        self._deaths_in_a_row += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self._deaths_in_a_row - 1))
        self._not_before = self.clock() + delay
        logger.warning(
            "spare engine process %s died (exit code %s); replacing it in %.0f s", spare.pid, spare.proc.exitcode, delay
        )
        m.SPARE_EVENTS.labels(event="died").inc()
        spare.end()  # its worker spare too, if any is left
        self.spare = None
        self._publish()

    def check(self) -> None:
        """Note a spare that became ready (``vlguard_engine_spare_up`` 1); count a dead one and replace it
        once its back-off has passed."""
        with self._lock:
            self._settle_death()
            if self.spare is not None and self.spare.state == "waiting":
                self._ready = self.spare.ready()
                if self._ready:
                    self._deaths_in_a_row = 0
                self._publish()
            elif self._wanted:
                self.replenish(self._config)

    def path(self) -> RebuildPath:
        """The path a rebuild would take now: through the spare if it is ready, through the spare still
        importing, or cold (no live spare). Reads the spare's readiness unless a check holds the keeper."""
        spare = self.spare
        if spare is None or not spare.alive():
            return RebuildPath.COLD
        if not self._ready and self._lock.acquire(blocking=False):
            try:
                self._ready = spare is self.spare and spare.ready()
            finally:
                self._lock.release()
        return RebuildPath.SPARE if self._ready else RebuildPath.SPARE_STARTING

    def pids(self) -> set[int]:
        """The waiting spare's process and its worker spare's (its child), or nothing."""
        spare = self.spare
        if spare is None or spare.pid is None or not spare.alive():
            return set()
        return {spare.pid} | watchdog.descendant_pids(spare.pid)

    def _publish(self) -> None:
        publish(self.path())

    def arm(self) -> RebuildPath:
        """The engine core of the next engine build runs in the spare if it is alive, ready or still
        importing (a spare still importing has a head start on a new process); a spare whose environment
        differs from this process's now is left to the hand-over, which refuses it. Never raises: a vLLM
        that starts its engine core some other way builds without the spare. Waits at most 5 s for a
        check in progress (it may be spawning a spare, which is then armed).

        Returns:
            the path the build takes: :attr:`RebuildPath.COLD` when no spare was armed, or it will be refused.
        """
        if not self._lock.acquire(timeout=5.0):
            logger.warning("spare keeper busy for 5 s: this rebuild spawns its engine processes")
            return RebuildPath.COLD
        try:
            self._settle_death()
            if self.spare is None or not self.spare.alive():
                return RebuildPath.COLD
            path = self.path()
            install(processes.ENGINE_CORE_STARTER)
            arm(self.spare, CORE_PROCESS)
            self._armed, self.spare = self.spare, None  # the next spare may be spawned meanwhile
            self._armed_ready = path is RebuildPath.SPARE
            self._publish()
            return RebuildPath.COLD if env_differences(self._armed.env, dict(os.environ)) else path
        except (ImportError, AttributeError):
            logger.warning("this vLLM starts its engine core elsewhere: no spare is used", exc_info=True)
            return RebuildPath.COLD
        finally:
            self._lock.release()

    def after_build(self) -> None:
        """Settle the armed spare after a build, successful or not: used, refused, or given back (the
        build failed before it started its engine core) unless a new spare was spawned meanwhile."""
        from server.metrics import definitions as m

        disarm(CORE_PROCESS)
        with self._lock:
            armed, self._armed = self._armed, None
            if armed is None:
                return
            if armed.state == "waiting":
                if self.spare is None and armed.alive():
                    self.spare, self._ready = armed, False  # the next check() reads its readiness
                    self._publish()
                else:
                    armed.end()
                return
        m.SPARE_EVENTS.labels(event="used" if armed.state == "used" else "refused").inc()

    def close(self) -> None:
        """End the spare (shutdown); no spare is spawned afterwards. Idempotent."""
        with self._lock:
            self._closed, self._wanted = True, False
            spares, self.spare, self._armed = (self.spare, self._armed), None, None
            self._publish()
        for spare in spares:
            if spare is not None:
                spare.end()  # an armed one only if it was not handed over
