"""The supervisor: owns the vLLM ``AsyncLLM`` engine and its lifecycle state.

States: STARTING -> READY; STOPPED after shutdown; FAILED when the engine cannot be built. The
engine is built off the event loop (``AsyncLLM`` start-up blocks for the whole model load), so the
server's loop keeps answering ``/health`` while it loads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from server.settings import GuardSettings

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

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
    """The engine is not READY (starting, restarting, failed or stopped). HTTP 503."""


class Supervisor:
    """Builds, holds and shuts down one vLLM ``AsyncLLM`` from fixed engine arguments.

    Arguments:
        engine_args: the parsed ``vllm serve`` engine arguments; every (re)build uses these.
        settings: vlguard's own options.
    """

    def __init__(self, engine_args: AsyncEngineArgs, settings: GuardSettings) -> None:
        self.engine_args = engine_args
        self.settings = settings
        self.state = EngineState.STOPPED
        self._engine: AsyncLLM | None = None
        self.ready_since: float | None = None

    @property
    def engine(self) -> AsyncLLM:
        """The current engine.

        Raises:
            EngineUnavailableError: no engine is READY.
        """
        if self._engine is None or self.state is not EngineState.READY:
            raise EngineUnavailableError(f"engine is {self.state.value}")
        return self._engine

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

    async def start(self) -> None:
        """Build the engine and mark it READY.

        Raises:
            TimeoutError: start-up took longer than ``settings.startup_timeout`` seconds.
            Exception: whatever vLLM raised while building the engine (state becomes FAILED).
        """
        self.state = EngineState.STARTING
        started = time.monotonic()
        try:
            engine = await asyncio.wait_for(asyncio.to_thread(self._build), self.settings.startup_timeout)
            await engine.reset_mm_cache()  # drop the profiling run's dummy images
        except BaseException:
            self.state = EngineState.FAILED
            raise
        self._engine = engine
        self.state = EngineState.READY
        self.ready_since = time.monotonic()
        logger.info("engine ready in %.1f s", self.ready_since - started)

    def shutdown(self) -> None:
        """Shut the engine down (engine-core and worker processes exit). Idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Supervisor]:
        """Start the engine for the duration of the block; always shut it down afterwards."""
        try:
            await self.start()
            yield self
        finally:
            self.shutdown()
