"""Start, pause and stop real ``vlguard serve`` / stock vLLM OpenAI servers as subprocesses on loopback.

Used by the benchmarks and the tests. A server runs in its own process group with its log in a file,
is waited for through its readiness endpoint (failing fast with the log's tail when the process exits),
and is stopped with SIGTERM, then SIGKILL for whatever of its process tree remains. A benchmark can
SIGSTOP a whole server (``pause``) so its idle engine and OpenMP threads take no cores from the server
being measured.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _label(proc: psutil.Process) -> str:
    """A process's command line and name (vLLM retitles its processes ``VLLM::EngineCore`` etc.)."""
    return " ".join(proc.cmdline()) + " " + proc.name()


def engine_env(**extra: str) -> dict[str, str]:
    """The environment for a CPU engine: 1 GiB KV cache (unless set), no usage stats, plus ``extra``."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.update(extra)
    return env


def metric_samples(url: str, *prefixes: str, by_label: str | None = None) -> dict[str, float]:
    """The samples on ``url``/metrics whose names start with one of ``prefixes`` (all when none given),
    summed over their labels. With ``by_label``, samples carrying that label are kept apart, keyed
    ``name{value}`` (e.g. ``vlguard_alignment_steps_total{filled}``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if prefixes and not s.name.startswith(prefixes):
                continue
            key = s.name + (f"{{{s.labels[by_label]}}}" if by_label and by_label in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


@contextmanager
def rss_peak(pid: int, every_s: float = 0.1, tree: bool = False) -> Iterator[list[int]]:
    """Sample the resident memory of process ``pid`` (with ``tree``: summed with its descendants') every
    ``every_s`` seconds while the block runs; yields a one-item list holding the peak seen so far (bytes),
    final once the block has left."""
    peak, stop = [0], threading.Event()
    proc = psutil.Process(pid)

    def rss() -> int:
        total = proc.memory_info().rss
        for child in proc.children(recursive=True) if tree else ():
            with contextlib.suppress(psutil.Error):  # a child that ended meanwhile
                total += child.memory_info().rss
        return total

    def watch() -> None:
        while True:
            try:
                peak[0] = max(peak[0], rss())
            except psutil.Error:
                return
            if stop.wait(every_s):
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        stop.set()
        watcher.join()


def vlguard_command(model: str | Path, *serve_args: str) -> list[str]:
    """``python -m server serve MODEL ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "server", "serve", str(model), *serve_args]


#: ``vllm serve`` flags only its launcher reads: ``python -m vllm.entrypoints.openai.api_server`` ignores them.
LAUNCHER_FLAGS = ("--api-server-count", "-asc", "--headless")


def stock_command(model: str | Path, *serve_args: str) -> list[str]:
    """The stock vLLM OpenAI server with this interpreter: ``python -m vllm.entrypoints.openai.api_server``, or,
    when ``serve_args`` hold a flag only ``vllm serve``'s launcher reads (:data:`LAUNCHER_FLAGS`), ``vllm serve``
    itself (:mod:`server.workload.stock_serve`). The ``vllm`` script cannot be used: the CPU build is distributed
    as ``vllm-cpu``, and its console script cannot find the ``vllm`` distribution.

    Not ``vllm serve`` always: its CLI makes vLLM spawn its engine processes where the module forks them on the
    CPU, and every stock start and restart in the test suite took longer (the default lane took 1816 s with it
    and this stop's other changes, 1410 s before).
    """
    if any(arg.split("=", 1)[0] in LAUNCHER_FLAGS for arg in serve_args):
        return [sys.executable, "-m", "server.workload.stock_serve", str(model), *serve_args]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *serve_args]


@dataclass
class ServerProcess:
    """One server subprocess on ``127.0.0.1:port``.

    ``ready_path`` is ``/ready`` for vlguard (engine up) and ``/health`` for stock vLLM.
    """

    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=engine_env)
    port: int = field(default_factory=free_port)
    ready_path: str = "/ready"
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Start (or start again, on the same port) the server process; does not wait."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout_s: float = 900.0) -> ServerProcess:
        """Poll the readiness endpoint until 200.

        Raises:
            RuntimeError: the process exited (message carries the log's tail).
            TimeoutError: not ready within ``timeout_s`` seconds.
        """
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

    def engine_core(self) -> psutil.Process:
        """The ``VLLM::EngineCore`` child process. Raises ``LookupError`` when there is none."""
        for child in self.children():
            try:
                if "EngineCore" in _label(child):
                    return child
            except psutil.NoSuchProcess:
                continue
        raise LookupError("no VLLM::EngineCore process under the server")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, seconds) used so far by each process role of the server: ``api`` (the
        server process itself), ``engine_core``, ``worker`` and ``other`` children."""
        assert self.proc is not None
        used: dict[str, float] = {}
        try:
            procs = [psutil.Process(self.proc.pid), *self.children()]
        except psutil.NoSuchProcess:
            return used
        for proc in procs:
            try:
                label = _label(proc)
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            role = ("api" if proc.pid == self.proc.pid else "engine_core" if "EngineCore" in label
                    else "worker" if "Worker" in label else "other")  # fmt: skip
            used[role] = used.get(role, 0.0) + times.user + times.system
        return used

    def pause(self) -> None:
        """SIGSTOP the server's whole process group."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the server's whole process group."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole tree. Returns the exit status."""
        if self.proc is None:
            return None
        tree = self.children()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
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
