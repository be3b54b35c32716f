"""The engine client handed to vLLM's OpenAI serving classes.

This is the seam between vLLM's serving layer and the supervised engine: the serving classes call
``generate()``/``abort()`` and read ``model_config``, ``renderer`` and friends exactly as they would on an
``AsyncLLM``, but every call goes through the supervisor to whatever engine is current. Request
holding, replay and resume during engine restarts live here.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

    from server.guard.supervisor import Supervisor


class GuardedEngineClient:
    """Duck-typed ``vllm.engine.protocol.EngineClient`` over the supervisor's current engine.

    Arguments:
        supervisor: owns the engine; ``supervisor.engine`` raises when it is not READY.
    """

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream ``RequestOutput`` objects for one request (same contract as ``AsyncLLM.generate``).

        Raises:
            EngineUnavailableError: the engine is not READY.
            vllm.v1.engine.exceptions.EngineDeadError: the engine died while the request was in flight.
        """
        engine = self._supervisor.engine
        async for output in engine.generate(prompt, sampling_params, request_id, **kwargs):
            yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests in the current engine (no-op when no engine is READY)."""
        if self._supervisor.state.value == "ready":
            await self._supervisor.engine.abort(request_id)

    @property
    def errored(self) -> bool:
        """True when the current engine has died (vLLM's flag; the supervisor is the authority)."""
        try:
            return bool(self._supervisor.engine.errored)
        except RuntimeError:
            return True

    def __getattr__(self, name: str) -> Any:
        # Everything else (model_config, renderer, input_processor, vllm_config, get_supported_tasks,
        # check_health, do_log_stats, ...) is the current engine's own.
        return getattr(self._supervisor.engine, name)
