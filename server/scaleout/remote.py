"""An API process's engines when another process launches them (``--api-server-count N``, N > 1).

The owner (:mod:`server.scaleout.owner`) launches each engine core for N API processes and announces it on each
API process's control pipe (:class:`~server.scaleout.control.EngineUp`). :class:`RemoteEngines` is the
supervisor's engine factory in an API process: a build waits for an engine newer than the last one built here and
connects vLLM's ``AsyncLLM`` to it as client ``index`` of N (``client_addresses``, ``client_count``,
``client_index``: what vLLM's own API servers do). The engine's record directory and engine-core pids go with
it (:class:`~server.guard.lifecycle.Placement`), so the guard classifies, charges and watches as it does for an
engine of its own.

vLLM's client does not see the death of an engine core it did not launch (its engine-core monitor runs where
the engine was launched: docs/architecture.md, "Scaling out the API tier"). When the owner announces a death
(:class:`~server.scaleout.control.EngineDown`), the client is ended the way that monitor ends its own
(:func:`server.vllm_hooks.async_llm.end_client`): every request inside raises ``EngineDeadError`` and the guard
carries it over, as after any death.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from server.guard import watchdog
from server.guard.hold import RebuildPath
from server.guard.lifecycle import Engine, Placement
from server.scaleout.control import EngineDown, EngineUp, Progress, SparePath
from server.scaleout.link import OwnerLink
from server.vllm_hooks import async_llm

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

logger = logging.getLogger("server.guard.supervisor")

#: How often an API process tells the others it received step outputs, at most (seconds).
PROGRESS_EVERY_S = 1.0


class OwnersSpare:
    """The spare engine process as an API process sees it (:class:`~server.guard.spare.Spares`): the owner keeps
    it and says which path its next rebuild would take (:class:`~server.scaleout.control.SparePath`), so this
    process's hold and build limits, ``/ready``'s ``rebuild`` and the measured rebuild times follow the owner's
    spare. Nothing to spawn, check or end here."""

    def __init__(self, link: OwnerLink) -> None:
        self._path = RebuildPath.COLD
        link.on(SparePath, self._told)

    def _told(self, message: SparePath) -> None:
        self._path = message.path

    def path(self) -> RebuildPath:
        return self._path

    def arm(self) -> RebuildPath:
        return self._path

    def pids(self) -> set[int]:
        return set()

    def after_build(self) -> None:
        return None

    def replenish(self, vllm_config: object) -> None:
        return None

    def check(self) -> None:
        return None

    def close(self) -> None:
        return None


#: While a build waits, how often it looks again at the announced engine core's processes (seconds): one this
#: API process found dead itself (its watch, or its guard ending a hung one) is not built again.
RECHECK_S = 0.5


class RemoteEngines:
    """The engine factory of API process ``index`` of ``count``: a build takes the newest engine the owner
    announced that was not announced dead and whose engine core still runs, waiting for one if need be, and
    connects a client to it. Each build takes a ticket: a build the guard abandoned (past its time limit) gives
    up once a newer one starts, so it never takes an engine from it.

    Arguments:
        link: this API process's link to the owner (announcements arrive on it).
        engine_args: vLLM's engine arguments (this process's ``_api_process_count`` and ``_api_process_rank``
            are set here; the configuration is made once, at the first build).
        index, count: this API process's client index, and N.
        wait_s: how long a build waits for an engine (seconds) before it raises ``TimeoutError``.
    """

    def __init__(self, link: OwnerLink, engine_args: AsyncEngineArgs, index: int, count: int, wait_s: float) -> None:
        engine_args._api_process_count, engine_args._api_process_rank = count, index
        self.link, self.engine_args, self.index, self.count, self.wait_s = link, engine_args, index, count, wait_s
        self._progress_sent = 0.0
        self._config: Any = None
        self._changed = threading.Condition()
        self._announced: EngineUp | None = None  # the newest engine the owner announced
        self._down: set[int] = set()  # the owner's generations announced dead
        self._built: dict[int, Engine] = {}  # the owner's generation -> the client built here for it
        self._ticket = 0  # the newest build's
        self.owner_gone = False
        link.on(EngineUp, self._up)
        link.on(EngineDown, lambda down: self._end(down.generation))
        link.on_gone(self._owner_gone)

    def _progressed(self) -> None:
        """This process received step outputs: tell the others (at most every :data:`PROGRESS_EVERY_S`)."""
        if (now := time.monotonic()) - self._progress_sent >= PROGRESS_EVERY_S:
            self._progress_sent = now
            self.link.send(Progress(self.index))

    def _up(self, up: EngineUp) -> None:
        with self._changed:
            self._announced = up
            self._changed.notify_all()

    def _end(self, *generations: int) -> None:
        """Engines ``generations`` are dead: end the clients built for them here."""
        with self._changed:
            self._down.update(generations)
            for generation in generations:
                if (engine := self._built.pop(generation, None)) is not None:
                    async_llm.end_client(engine)
            self._changed.notify_all()

    def _owner_gone(self) -> None:  # its engine with it
        with self._changed:
            self.owner_gone = True
            built = list(self._built)
        self._end(*built)

    def _next(self, ticket: int) -> EngineUp:
        """The engine build ``ticket`` connects to (blocks; see the class).

        Raises:
            TimeoutError: none within ``wait_s`` seconds.
            RuntimeError: the owner is gone, or a newer build started.
        """
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            while True:
                if self.owner_gone:
                    raise RuntimeError("the owner of the engine is gone")
                if ticket != self._ticket:
                    raise RuntimeError("a newer engine build started")
                up = self._announced
                if up is not None and up.generation not in self._down and not watchdog.process_problem(list(up.pids)):
                    return up
                if (left := deadline - time.monotonic()) <= 0:
                    raise TimeoutError(f"no live engine announced within {self.wait_s:.0f} s")
                self._changed.wait(min(left, RECHECK_S))

    def __call__(self) -> Engine:
        """A client of the next engine the owner announces (blocks; run off the event loop).

        Raises:
            TimeoutError: none announced within ``wait_s`` seconds.
            RuntimeError: the owner is gone, or a newer build started.
            Exception: whatever vLLM raised while connecting.
        """
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        with self._changed:
            self._ticket += 1
            ticket = self._ticket
            self._changed.notify_all()  # an abandoned build still waiting gives up
        if self._config is None:
            self._config = self.engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        up = self._next(ticket)
        started = time.monotonic()
        engine = AsyncLLM.from_vllm_config(
            vllm_config=self._config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=self.engine_args.enable_log_requests,
            aggregate_engine_logging=self.engine_args.aggregate_engine_logging,
            disable_log_stats=self.engine_args.disable_log_stats,
            client_addresses=up.addresses,
            client_count=self.count,
            client_index=self.index,
        )
        Placement(up.directory, list(up.pids)).attach(engine)
        async_llm.on_engine_core_output(engine, self._progressed)
        with self._changed:
            if up.generation in self._down:  # it died while this client connected
                async_llm.end_client(engine)
            else:
                self._built = {up.generation: engine}
        logger.info(
            "API process %d connected to engine %d in %.2f s", self.index, up.generation, time.monotonic() - started
        )
        return engine


__all__ = ["OwnersSpare", "RemoteEngines"]
