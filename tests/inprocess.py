"""vlguard's app in-process: the real FastAPI app (``create_app``), vLLM's real serving layer, tokenizer,
chat template and multimodal processor on the tiny model, over a :class:`tests.fakes.FakeEngine` in
place of the engine core. Requests go through ``httpx.ASGITransport``: no port, no subprocess, no engine
start-up, so every status vlguard itself produces is tested in milliseconds.

The engine configuration, renderer and input processor are built once per test session from the tiny
profile; the flags an app is made with must not change the engine configuration (front-end flags such as
``--api-key`` or ``--allowed-origins``, and ``--guard-*`` flags, are fine).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from server.guard.supervisor import Supervisor
from tests.fakes import FakeEngineFactory
from tests.servers import TINY_PROFILE


@dataclass
class EngineParts:
    """What ``AsyncLLM`` builds in the API process, built once: config, renderer, input processor."""

    model: str
    vllm_config: Any
    renderer: Any
    input_processor: Any

    @classmethod
    def build(cls, model: Path) -> EngineParts:
        """As ``vlguard serve`` builds them (the processor cache in its replay-safe form)."""
        from server.workload.front import api_side_parts

        _, _, vllm_config, renderer, input_processor = api_side_parts(
            str(model), ["--config", str(TINY_PROFILE)], guard=True
        )
        return cls(str(model), vllm_config, renderer, input_processor)

    def engine_attributes(self) -> dict[str, Any]:
        """The attributes vLLM's serving layer reads from the engine client."""

        async def supported_tasks() -> tuple[str, ...]:
            return ("generate",)

        async def no() -> bool:
            return False

        async def nothing() -> None:
            return None

        return {
            "vllm_config": self.vllm_config,
            "model_config": self.vllm_config.model_config,
            "renderer": self.renderer,
            "input_processor": self.input_processor,
            "get_supported_tasks": supported_tasks,
            "is_tracing_enabled": no,
            "do_log_stats": nothing,
        }


def serve_args(model: str, *flags: str) -> Any:
    """``vlguard serve MODEL --config tiny-cpu.yaml FLAGS``, parsed: ``(args, settings)``."""
    from server.args import resolve_serve_args

    return resolve_serve_args(["serve", model, "--config", str(TINY_PROFILE), *flags])


@dataclass
class Api:
    """One in-process vlguard: its HTTP client, supervisor and fake engines."""

    client: httpx.AsyncClient
    supervisor: Supervisor
    factory: FakeEngineFactory
    model: str
    app: Any = None

    @property
    def engine(self) -> Any:
        """The fake engine built last."""
        return self.factory.current


@contextlib.asynccontextmanager
async def running_api(parts: EngineParts, *flags: str, poison: Iterable[int] = ()) -> AsyncIterator[Api]:
    """Start vlguard's app (lifespan included) with ``flags`` on fake engines; shut it down afterwards.

    Arguments:
        parts: the session's engine parts.
        flags: ``vlguard serve`` flags (front-end and ``--guard-*`` only).
        poison: token ids that kill a fake engine at the first step of a request holding one.
    """
    from server.app import create_app

    args, settings = serve_args(parts.model, *flags)
    factory = FakeEngineFactory(poison=poison, **parts.engine_attributes())
    supervisor = Supervisor(factory, settings)
    app = create_app(args, settings, supervisor)
    async with app.router.lifespan_context(app):
        # As uvicorn: an exception the app re-raises after answering (Starlette does for 500s) is not the client's.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://vlguard.test", timeout=30) as client:
            yield Api(client, supervisor, factory, parts.model, app)
