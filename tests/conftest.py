"""Shared fixtures: the tiny model (built once per session) and the real vlguard servers on it that
integration, deployment and observability tests share (one per session, started on first use)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerProcess, vlguard_argv


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny Qwen3-VL, written once per test session."""
    from server.devmodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``vlguard serve`` (default: compiled, patches on) on the tiny model, on a free loopback port."""
    log = tmp_path_factory.mktemp("logs") / "vlguard.log"
    srv = ServerProcess(vlguard_argv(tiny_model), log).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def eager_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``vlguard serve --enforce-eager`` (patches on) on the tiny model: the numerical reference."""
    log = tmp_path_factory.mktemp("logs") / "vlguard-eager.log"
    srv = ServerProcess(vlguard_argv(tiny_model, "--enforce-eager"), log).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def openai_client(server: ServerProcess):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def model_name(tiny_model: Path) -> str:
    return str(tiny_model)
