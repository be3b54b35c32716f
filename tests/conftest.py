"""Shared fixtures: the tiny model (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny Qwen3-VL, written once per test session."""
    from server.devmodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-vl"))
