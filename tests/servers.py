"""Start and stop real ``vlguard serve`` / stock vLLM servers as subprocesses on loopback.

A server is started in its own process group with its log in a file, waited for through its readiness
endpoint (failing fast with the log's tail when the process exits), and stopped with SIGTERM, then
SIGKILL for whatever of its process tree remains.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
TINY_PROFILE = REPO / "config" / "tiny-cpu.yaml"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(**extra: str) -> dict[str, str]:
    """The environment for a CPU engine: small KV cache, no usage stats."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    env.update(extra)
    return env


@dataclass
class ServerProcess:
    """One server subprocess on ``127.0.0.1:port``."""

    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=engine_env)
    port: int = field(default_factory=free_port)
    ready_path: str = "/ready"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*self.argv, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=REPO,
            start_new_session=True,
        )
        return self

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout_s: float = 600.0) -> ServerProcess:
        """Poll the readiness endpoint until 200; raise with the log tail if the process exits."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.5)  # readiness poll interval
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def children(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole tree. Returns the exit status."""
        if self.proc is None:
            return None
        tree = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for child in tree:
            if child.is_running():
                child.kill()
        psutil.wait_procs(tree, timeout=10)
        return self.proc.returncode


def vlguard_argv(model: Path, *extra: str) -> list[str]:
    """``python -m server serve <model> --config tiny-cpu.yaml <extra>`` with this interpreter."""
    return [sys.executable, "-m", "server", "serve", str(model), "--config", str(TINY_PROFILE), *extra]
