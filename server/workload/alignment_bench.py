"""Alignment benchmark: the two-pass workload with chunk alignment on vs off, side by side in one run.

Both servers run vlguard with the deepstack patches on (so the unaligned one survives padding) on the
same model and profile. Rounds alternate between them (on, off, on, off, ...); each round sends
``--pairs`` fresh images (cropped variants: no cache reuse across rounds) as primary then rescue passes,
``--concurrency`` pairs at a time, greedy, ``--max-tokens`` each; ``--warmup`` rounds first, not counted.
Printed per system: wall time, tokens per second (prompt + completion, from the responses' usage),
engine steps (``vllm:iteration_tokens_total`` count), and vlguard's alignment counters; then the ratios
on/off: overall, and the median of the per-round ratios (each round's two runs are adjacent in time,
which cancels most of the machine's drift). The server not being measured is SIGSTOPped (its whole
process group), so its idle engine and OpenMP threads cannot take cores from the one being measured.

On a CPU there is no CUDA-graph padding: ``--emulate-padding`` (default) loads the test plugin that
emulates it (``tests/plugins``; development environment only) and aligns to vLLM's default capture sizes
up to 512. On a GPU pass ``--no-emulate-padding`` and a GPU profile.

Usage: ``python -m server.workload.alignment_bench MODEL_DIR [--rounds 4] [--pairs 8] [--concurrency 4]``
(loopback only; both servers are stopped when it ends).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.workload.images import PHOTOS, variant_uri
from server.workload.twopass import primary_messages, rescue_messages

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "config" / "tiny-cpu.yaml"
SYSTEMS = {"aligned": ["--guard-alignment", "on"], "unaligned": ["--guard-alignment", "off"]}


@dataclass
class Totals:
    system: str
    seconds: float = 0.0
    tokens: int = 0
    requests: int = 0
    failed: int = 0
    steps: float = 0.0
    recomputed: float = 0.0
    deferred: float = 0.0
    outcomes: dict[str, float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(system: str, model: str, emulate: bool, log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    argv = [sys.executable, "-m", "server", "serve", model, "--config", str(PROFILE), *SYSTEMS[system]]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "VLLM_NO_USAGE_STATS": "1"}  # CPU: 1 GiB KV cache each
    if emulate:
        argv += ["--guard-alignment-max-capture-size", "512"]
        env["VLGUARD_TEST_EMULATE_PADDING"] = "1"
    log = (log_dir / f"{system}.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)  # readiness poll interval
    raise TimeoutError(url)


def _counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "vllm:iteration_tokens_total_count":
                out["steps"] = out.get("steps", 0.0) + s.value
            elif s.name.startswith("vlguard_alignment_"):
                key = s.name + (f"{{{s.labels['outcome']}}}" if "outcome" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def _pair(client: httpx.Client, url: str, model: str, image: str, max_tokens: int) -> tuple[int, int]:
    """Primary then rescue on one image. Returns (tokens, failures)."""
    tokens = failures = 0
    for messages in (primary_messages(image), rescue_messages(image)):
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        resp = client.post(url + "/v1/chat/completions", json=body, timeout=300)
        if resp.status_code == 200:
            tokens += resp.json()["usage"]["total_tokens"]
        else:
            failures += 1
    return tokens, failures


def _round(url: str, model: str, images: list[str], concurrency: int, max_tokens: int) -> tuple[float, int, int]:
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda img: _pair(client, url, model, img, max_tokens), images))
        return time.perf_counter() - start, sum(t for t, _ in results), sum(f for _, f in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    parser.add_argument("--pairs", type=int, default=8, help="images (primary + rescue each) per round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--emulate-padding", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=Path("bench-out/alignment.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    procs = {s: _start(s, args.model, args.emulate_padding, args.out.parent) for s in SYSTEMS}
    try:
        for proc, url in procs.values():
            _wait_ready(proc, url)
        model = httpx.get(procs["aligned"][1] + "/v1/models").json()["data"][0]["id"]
        before = {s: _counters(url) for s, (_, url) in procs.items()}
        for proc, _ in procs.values():
            os.killpg(proc.pid, signal.SIGSTOP)
        names = list(PHOTOS)
        totals = {s: Totals(s) for s in SYSTEMS}
        round_ratios: list[float] = []
        for rnd in range(-args.warmup, args.rounds):
            if rnd == 0:
                for system, (proc, url) in procs.items():
                    os.killpg(proc.pid, signal.SIGCONT)
                    before[system] = _counters(url)
                    os.killpg(proc.pid, signal.SIGSTOP)
            # The same fresh images for both systems in a round; never seen before by either.
            first = 1 + (rnd + args.warmup) * args.pairs
            images = [variant_uri(names[i % len(names)], first + i) for i in range(args.pairs)]
            rate = {}
            for system in SYSTEMS if rnd % 2 == 0 else reversed(list(SYSTEMS)):
                os.killpg(procs[system][0].pid, signal.SIGCONT)
                seconds, tokens, failed = _round(procs[system][1], model, images, args.concurrency, args.max_tokens)
                os.killpg(procs[system][0].pid, signal.SIGSTOP)
                rate[system] = tokens / seconds
                if rnd < 0:
                    continue
                t = totals[system]
                t.seconds, t.tokens, t.failed = t.seconds + seconds, t.tokens + tokens, t.failed + failed
                t.requests += 2 * len(images)
            if rnd >= 0:
                round_ratios.append(rate["aligned"] / rate["unaligned"])
        for system, (proc, url) in procs.items():
            os.killpg(proc.pid, signal.SIGCONT)
            after, t = _counters(url), totals[system]
            delta = {k: v - before[system].get(k, 0.0) for k, v in after.items()}
            t.steps = delta.get("steps", 0.0)
            t.recomputed = delta.get("vlguard_alignment_recomputed_tokens_total", 0.0)
            t.deferred = delta.get("vlguard_alignment_deferred_tokens_total", 0.0)
            t.outcomes = {k.split("{")[1][:-1]: v for k, v in delta.items() if k.startswith("vlguard_alignment_steps")}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs.values():
            proc.wait(60)

    on, off = totals["aligned"], totals["unaligned"]
    print(f"{'system':10} {'requests':>8} {'failed':>6} {'seconds':>8} {'tokens/s':>9} {'steps':>7} "
          f"{'recomputed':>10} {'deferred':>8}  outcomes")  # fmt: skip
    for t in (on, off):
        print(f"{t.system:10} {t.requests:8d} {t.failed:6d} {t.seconds:8.1f} {t.tokens_per_s:9.1f} {t.steps:7.0f} "
              f"{t.recomputed:10.0f} {t.deferred:8.0f}  {t.outcomes}")  # fmt: skip
    ratio = on.tokens_per_s / off.tokens_per_s if off.tokens_per_s else float("nan")
    median = statistics.median(round_ratios)
    print(f"throughput aligned/unaligned: {ratio:.3f} overall, {median:.3f} median of {len(round_ratios)} rounds "
          f"({(1 - median) * 100:+.1f} % cost); "
          f"steps aligned/unaligned: {on.steps / off.steps if off.steps else float('nan'):.3f}")  # fmt: skip
    result = {"aligned": asdict(on), "unaligned": asdict(off), "throughput_ratio": ratio, "round_ratios": round_ratios}
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
