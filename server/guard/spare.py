"""Keeping a spare engine process ready for the next rebuild (API process; the spare itself and the
hand-over are :mod:`server.engine.spare`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from server.engine.spare import CORE_MODULES, CORE_PROCESS, Spare, arm, disarm, install
from server.vllm_hooks import processes

logger = logging.getLogger("vllm.vlguard.spare")


class SpareKeeper:
    """Keeps one engine-core spare (with its worker spare) ready for the next rebuild of the engine.

    The supervisor calls :meth:`replenish` once an engine is READY (the spare is spawned for that
    engine's configuration), :meth:`check` on every watchdog tick (a dead spare is counted and replaced,
    after a back-off that doubles with each death in a row: a spare killed while importing, by a memory
    limit say, must not be respawned every tick), :meth:`arm` before a rebuild and :meth:`after_build`
    after it, and :meth:`close` at shutdown. ``vlguard_engine_spare_up`` is 1 while a spare and its worker
    spare are ready; ``vlguard_engine_spare_events_total{event}`` counts spawned, died, used and refused
    spares. Spawning blocks (the configuration is pickled to the child): call it off the event loop.

    Arguments:
        modules: what the engine core's spare imports.
        backoff_s: wait before replacing a spare after its first death in a row (then 2x, 4x..., at most
            ``max_backoff_s``).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        modules: Iterable[str] = CORE_MODULES,
        backoff_s: float = 10.0,
        max_backoff_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.modules = tuple(modules)
        self.backoff_s, self.max_backoff_s, self.clock = backoff_s, max_backoff_s, clock
        self.spare: Spare | None = None
        self._config: object | None = None
        self._wanted = False  # replenish() was called and close() was not
        self._closed = False
        self._deaths_in_a_row = 0
        self._not_before = 0.0  # no replacement before this time (back-off)
        self._fork_noted = False
        self._lock = threading.RLock()  # the watchdog's check (a thread) vs a rebuild's arm (the loop)

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
            self.spare = Spare(self.modules, worker_spare_for=vllm_config)
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
        m.SPARE_UP.set(0)
        spare.end()  # its worker spare too, if any is left
        self.spare = None

    def check(self) -> None:
        """Note a spare that became ready (``vlguard_engine_spare_up`` 1); count a dead one and replace it
        once its back-off has passed."""
        from server.metrics import definitions as m

        with self._lock:
            self._settle_death()
            if self.spare is not None and self.spare.state == "waiting":
                ready = self.spare.ready()
                if ready:
                    self._deaths_in_a_row = 0
                m.SPARE_UP.set(1 if ready else 0)
            elif self._wanted:
                self.replenish(self._config)

    def arm(self) -> None:
        """The engine core of the next engine build runs in the spare, if it is alive (it is refused at
        the hand-over if the environment differs). Never raises: a vLLM that starts its engine core some
        other way builds without the spare. Does not wait for a check in progress (it may be spawning a
        spare, which could not be ready for this build anyway)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._settle_death()
            if self.spare is None or not self.spare.alive():
                return
            install(processes.ENGINE_CORE_STARTER)
            arm(self.spare, CORE_PROCESS)
        except (ImportError, AttributeError):
            logger.warning("this vLLM starts its engine core elsewhere: no spare is used", exc_info=True)
        finally:
            self._lock.release()

    def after_build(self) -> None:
        """Settle the armed spare after a build, successful or not: used, refused, or still waiting."""
        from server.metrics import definitions as m

        disarm(CORE_PROCESS)
        with self._lock:
            spare = self.spare
            if spare is None or spare.state == "waiting":
                return
            self.spare = None
        m.SPARE_UP.set(0)
        m.SPARE_EVENTS.labels(event="used" if spare.state == "used" else "refused").inc()

    def close(self) -> None:
        """End the spare (shutdown); no spare is spawned afterwards. Idempotent."""
        from server.metrics import definitions as m

        with self._lock:
            self._closed, self._wanted = True, False
            spare, self.spare = self.spare, None
        if spare is not None:
            spare.end()
        m.SPARE_UP.set(0)
