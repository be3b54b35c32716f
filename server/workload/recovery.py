"""Recovery benchmark: vlguard's in-process restart vs the stock vLLM server restarted as a process.

For each system, in one run on the same machine and model: start it, drive a fixed closed-loop load
(``--concurrency`` clients, ``--requests`` requests in all, mixed image and text, non-streaming), SIGKILL
the ``VLLM::EngineCore`` process once ``--kill-after`` requests have succeeded, and record every
request's outcome. The stock server exits on engine death (status 0); this harness plays systemd with
``Restart=always`` and starts it again at once, so its numbers include the cold start. Printed: time
from the kill to the first successful request after it, failed requests, and the ratios.

Usage: ``python -m server.workload.recovery MODEL_DIR [--requests 60] [--concurrency 4] [--out FILE]``
(loopback only; every server it starts is stopped when it ends).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from server.workload.images import photo_uri
from server.workload.twopass import primary_messages, rescue_messages

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "config" / "tiny-cpu.yaml"


@dataclass
class Result:
    system: str
    kill_at: float = 0.0
    first_success_after_kill_s: float | None = None
    failed: int = 0
    succeeded: int = 0
    outcomes: list[tuple[float, bool]] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _argv(system: str, model: str, port: int) -> list[str]:
    common = ["--config", str(PROFILE), "--host", "127.0.0.1", "--port", str(port)]
    if system == "vlguard":
        return [sys.executable, "-m", "server", "serve", model, *common]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *common]


def _wait(url: str, path: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)  # readiness poll
    raise TimeoutError(url + path)


def _engine_core(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()):
            return child
    raise RuntimeError("no engine core")


def run_system(system: str, model: str, requests: int, concurrency: int, kill_after: int, log_dir: Path) -> Result:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    ready_path = "/ready" if system == "vlguard" else "/health"
    log = (log_dir / f"{system}.log").open("wb")
    procs = [subprocess.Popen(_argv(system, model, port), stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)]  # fmt: skip
    result = Result(system)
    lock = threading.Lock()
    killed = threading.Event()
    stop_supervising = threading.Event()
    try:
        _wait(url, ready_path)

        def supervise() -> None:  # systemd Restart=always (with a start limit) for the stock server
            while not stop_supervising.is_set() and len(procs) < 10:
                if procs[-1].poll() is not None and system == "stock":
                    procs.append(subprocess.Popen(_argv(system, model, port), stdout=log, stderr=subprocess.STDOUT,
                                                  env=env, start_new_session=True))  # fmt: skip
                time.sleep(0.2)

        threading.Thread(target=supervise, daemon=True).start()
        images = [photo_uri(n) for n in ("astronaut.png", "coffee.png", "rocket.jpg", "chelsea.png")]
        served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

        def one(i: int, counted: bool = True) -> bool:
            started = time.monotonic()
            image = images[i % len(images)]
            messages = primary_messages(image) if i % 3 else rescue_messages(image)
            if i % 4 == 0:
                messages = [{"role": "user", "content": f"Safety report number {i}."}]
            body = {"model": served, "messages": messages, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            ok = False
            try:
                ok = httpx.post(url + "/v1/chat/completions", json=body, timeout=900).status_code == 200
            except httpx.TransportError:
                ok = False
            now = time.monotonic()
            with lock:
                if counted:
                    result.outcomes.append((now, ok))
                    result.succeeded += ok
                    result.failed += not ok
                # Recovery = the first success of a request sent after the kill.
                if ok and killed.is_set() and started > result.kill_at:
                    recovered = now - result.kill_at
                    if result.first_success_after_kill_s is None or recovered < result.first_success_after_kill_s:
                        result.first_success_after_kill_s = recovered
                if result.succeeded == kill_after and not killed.is_set():
                    result.kill_at = time.monotonic()
                    _engine_core(procs[-1].pid).send_signal(signal.SIGKILL)
                    killed.set()
            return ok

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))
        # The load ended before the system recovered (a stock server refuses connections while it
        # restarts): keep probing with real requests, outside the counted load, until one succeeds.
        probe = requests
        while result.first_success_after_kill_s is None and killed.is_set():
            started = time.monotonic()
            if one(probe, counted=False):
                result.first_success_after_kill_s = time.monotonic() - result.kill_at
            probe += 1
            if time.monotonic() - started < 0.5:
                time.sleep(0.5)  # probe pacing while the server is down
    finally:
        stop_supervising.set()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kill-after", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench-out/recovery.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = [
        run_system(system, args.model, args.requests, args.concurrency, args.kill_after, args.out.parent)
        for system in ("vlguard", "stock")
    ]
    vg, stock = results
    print(f"{'system':10} {'first success after kill (s)':>30} {'failed':>8} {'succeeded':>10}")
    for r in results:
        print(f"{r.system:10} {r.first_success_after_kill_s or float('nan'):30.2f} {r.failed:8d} {r.succeeded:10d}")
    if vg.first_success_after_kill_s and stock.first_success_after_kill_s:
        print(
            f"recovery time ratio vlguard/stock: {vg.first_success_after_kill_s / stock.first_success_after_kill_s:.2f}"
        )
    print(f"failed requests: vlguard {vg.failed} / stock {stock.failed} of {args.requests} each")
    args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
