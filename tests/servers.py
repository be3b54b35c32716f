"""Real ``vlguard serve`` / stock vLLM servers for the tests: :mod:`server.workload.servers`, run from
this checkout (the working directory decides which ``server`` package ``python -m server`` imports), on
the tiny model's profile."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.workload import servers
from server.workload.servers import engine_env, free_port, metric_samples, vlguard_command

REPO = Path(__file__).resolve().parent.parent
TINY_PROFILE = REPO / "config" / "tiny-cpu.yaml"

__all__ = [
    "REPO",
    "TINY_PROFILE",
    "ServerProcess",
    "SharedServer",
    "engine_env",
    "free_port",
    "metric_samples",
    "vlguard_argv",
]


@dataclass
class ServerProcess(servers.ServerProcess):
    """:class:`server.workload.servers.ServerProcess` started in this checkout."""

    cwd: Path | None = REPO


@dataclass
class SharedServer(ServerProcess):
    """The session's shared server; ``first_text`` is the greedy answer to its first request (text-only)."""

    first_text: Any = None


def vlguard_argv(model: Path, *extra: str) -> list[str]:
    """``python -m server serve <model> --config tiny-cpu.yaml <extra>`` with this interpreter."""
    return vlguard_command(model, "--config", str(TINY_PROFILE), *extra)
