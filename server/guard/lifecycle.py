"""Engine lifecycle in the API process: build an engine off the event loop, share one renderer across the
engines a server runs, tear a dead engine down.

The supervisor (:mod:`server.guard.supervisor`) decides *when* to build and tear down; this module is
*how*, through vLLM's public constructor and the hooks of :mod:`server.vllm_hooks.async_llm`; nothing
here runs in the engine's processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.guard import watchdog
from server.metrics.registry import archive_dead_processes
from server.vllm_hooks import async_llm
from server.vllm_hooks.async_llm import ServingRenderer

logger = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineFactory",
    "Placement",
    "ServingRenderer",
    "build_async_llm",
    "in_daemon_thread",
    "teardown",
]

if TYPE_CHECKING:
    import psutil
    from vllm.engine.arg_utils import AsyncEngineArgs

#: The engine the supervisor runs: vLLM's ``AsyncLLM``, or a test's fake with the same surface
#: (``generate``, ``abort``, ``errored``, ``reset_mm_cache``, ``shutdown``, ``renderer``).
Engine = Any
EngineFactory = Callable[[], Engine]


@dataclass(frozen=True)
class Placement:
    """Where the engine core of an engine another process launched runs (``--api-server-count N``:
    :mod:`server.scaleout.remote`): its record directory and its process ids, which a client of vLLM's does not
    know. Attached to the engine (:meth:`attach`); the builder and the watch read it in place of their own.

    Attributes:
        directory: where its engine core writes its records (:mod:`server.engine.protocol`).
        pids: its engine-core process ids.
    """

    directory: str
    pids: list[int] = field(default_factory=list)

    def attach(self, engine: Engine) -> None:
        engine.vlguard_placement = self

    @staticmethod
    def of(engine: Engine) -> Placement | None:
        """``engine``'s placement, or None (an engine this process launched)."""
        found: Placement | None = getattr(engine, "vlguard_placement", None)
        return found


def build_async_llm(engine_args: AsyncEngineArgs, on_config: Callable[[object], None] | None = None) -> Engine:
    """A new vLLM ``AsyncLLM`` from ``engine_args`` (blocks for the whole model load; run it off the loop).

    Arguments:
        on_config: called with the ``VllmConfig`` once it is made, before vLLM starts its engine processes
            (the spare keeper spawns a spare there: :meth:`server.guard.spare.SpareKeeper.replenish`); an
            exception it raises is logged, not raised.
    """
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    if on_config is not None:
        try:
            on_config(vllm_config)
        except Exception:
            logger.exception("on_config failed; building the engine anyway")
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
    )


def in_daemon_thread(fn: EngineFactory) -> asyncio.Future[Engine]:
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


async def teardown(
    engine: Engine | None, pids: list[int], tree: list[psutil.Process], renderer: ServingRenderer
) -> None:
    """End a dead engine: kill its processes (a stopped or hung engine core cannot exit cleanly; the workers
    of a killed one are orphans by now), release its renderers, stop its output handler and shut its
    engine-core client down. Never raises."""
    killed = await asyncio.to_thread(watchdog.kill_tree, pids, tree)
    if engine is not None:
        renderer.release(engine)
        await async_llm.stop_engine_clients(engine)
    if killed:
        await asyncio.to_thread(archive_dead_processes)
