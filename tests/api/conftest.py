"""In-process HTTP tests (:mod:`tests.inprocess`): vlguard's own layer over vLLM's real serving layer
and a fake engine core. Fast; every engine lane runs them (vLLM's front end differs between lanes).

They share one event loop (the session's): the renderer built once per session binds its tokenizer's
executor to the loop it first runs in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.inprocess import Api, EngineParts, running_api

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # every lane runs them: tests/lanes.py
        if HERE in Path(item.path).parents and pytest_asyncio.is_async_test(item):
            item.add_marker(pytest.mark.asyncio(loop_scope="session"), append=False)


@pytest.fixture(scope="session")
def engine_parts(tiny_model: Path) -> EngineParts:
    return EngineParts.build(tiny_model)


@pytest_asyncio.fixture(loop_scope="session")
async def make_api(engine_parts: EngineParts) -> AsyncIterator[Callable[..., Any]]:
    """``await make_api(*flags, poison=...)``: a started in-process vlguard, shut down after the test."""
    async with AsyncExitStack() as stack:

        async def make(*flags: str, poison: tuple[int, ...] = ()) -> Api:
            return await stack.enter_async_context(running_api(engine_parts, *flags, poison=poison))

        yield make


@pytest_asyncio.fixture(loop_scope="session")
async def api(make_api: Callable[..., Any]) -> Api:
    """vlguard with the tiny profile's defaults, in-process."""
    result: Api = await make_api()
    return result
