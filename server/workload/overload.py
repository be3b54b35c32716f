"""``vlguard bench compare --scenario overload``: goodput when more arrives than the engine can serve.

Stock vLLM first, then vlguard, each on its own (the other stopped). Per system: the capacity, completions per
second from ``--concurrency`` callers in a closed loop (use the profile's ``max-num-seqs``); then an open-loop
flood at each of ``--multipliers`` times *stock's* capacity (so both systems are offered the same rates) for
``--point-duration`` seconds, callers giving up after ``--caller-timeout`` seconds
(:mod:`server.workload.flood`, at real-time priority where ``chrt -f`` may be used, reporting the rate it
really sent). Between points the engine drains (nothing running or waiting).

Per point: goodput (answers within the caller's timeout per second, over stock's capacity), refusals and how
fast they came, callers who gave up, the share of the tokens the engine generated that no caller received in
time (wasted), and the peak resident memory of the server's whole process tree.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.workload.compare import CompareOptions, System, system_server, wait_serving
from server.workload.flood import GAVE_UP
from server.workload.servers import ServerProcess, metric_samples, rss_peak

SYSTEMS = (System("stock", stock=True), System("vlguard"))
REFUSED = (429, 503)


@dataclass(frozen=True)
class Load:
    """The overload scenario's own options (see ``vlguard bench compare --help``)."""

    multipliers: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0)
    point_duration_s: float = 40.0
    caller_timeout_s: float = 15.0


@dataclass
class Point:
    """One flood's figures. Rates are per second; ``goodput`` is over stock's capacity."""

    multiplier: float
    rate_planned: float
    rate_sent: float
    lag_max_s: float
    sent: int
    answered: int
    goodput: float
    refused: int
    refusal_p50_ms: float | None
    gave_up: int
    errors: int
    generated_tokens: float
    wasted_share: float
    rss_peak_mb: float


def realtime_prefix() -> list[str]:
    """``chrt -f 10`` where this process may use it (root or CAP_SYS_NICE), else nothing (the flood then
    runs at normal priority, said in the output)."""
    chrt = shutil.which("chrt")
    if chrt and subprocess.run([chrt, "-f", "10", "true"], capture_output=True).returncode == 0:
        return [chrt, "-f", "10"]
    return []


def flood(srv: ServerProcess, out: Path, *, first: int, opts: CompareOptions, load: Load,
          rate: float | None = None, callers: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Run :mod:`server.workload.flood` against ``srv`` (``rate`` open loop or ``callers`` closed loop);
    returns its JSON plus ``realtime`` (whether it ran at real-time priority)."""
    prefix = realtime_prefix()
    wl = opts.workload
    cmd = [*prefix, sys.executable, "-m", "server.workload.flood", srv.url,
           *(["--rate", str(rate)] if rate else ["--callers", str(callers)]),
           "--duration", str(load.point_duration_s), "--timeout", str(load.caller_timeout_s),
           "--max-tokens", str(wl.max_tokens), "--image-sizes", ",".join(map(str, wl.image_sizes)),
           "--seed", str(wl.seed), "--first", str(first), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text()) | {"realtime": bool(prefix)}


def drained(srv: ServerProcess, timeout_s: float = 300.0) -> None:
    """Wait until the engine has nothing running or waiting (raises ``TimeoutError`` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = metric_samples(srv.url, "vllm:num_requests_")
        if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0:
            return
        time.sleep(0.5)
    raise TimeoutError("the engine did not drain")


def point(srv: ServerProcess, rate: float, multiplier: float, capacity: float, *, first: int, opts: CompareOptions,
          load: Load, stem: Path) -> tuple[Point, dict[str, Any]]:  # fmt: skip
    """One open-loop flood at ``rate`` and its figures (and the flood's raw output)."""
    drained(srv)
    before = metric_samples(srv.url, "vllm:generation_tokens")
    assert srv.proc is not None
    with rss_peak(srv.proc.pid, 0.2, tree=True) as peak:
        raw = flood(srv, stem.with_name(f"{stem.name}-{multiplier:g}x.json"), first=first, opts=opts, load=load,
                    rate=rate)  # fmt: skip
    drained(srv)
    after = metric_samples(srv.url, "vllm:generation_tokens")
    generated = after.get("vllm:generation_tokens_total", 0.0) - before.get("vllm:generation_tokens_total", 0.0)
    reqs = raw["requests"]
    ok = [r for r in reqs if r[1] == 200]
    refused = [r[2] * 1000 for r in reqs if r[1] in REFUSED]
    delivered = sum(r[3] for r in ok)
    return Point(
        multiplier=multiplier,
        rate_planned=rate,
        rate_sent=raw["rate_sent"],
        lag_max_s=raw["lag_max_s"],
        sent=len(reqs),
        answered=len(ok),
        goodput=len(ok) / load.point_duration_s / capacity,
        refused=len(refused),
        refusal_p50_ms=statistics.median(refused) if refused else None,
        gave_up=sum(1 for r in reqs if r[1] == GAVE_UP),
        errors=sum(1 for r in reqs if r[1] not in (200, GAVE_UP, *REFUSED)),
        generated_tokens=generated,
        wasted_share=max(0.0, generated - delivered) / generated if generated else 0.0,
        rss_peak_mb=peak[0] / 2**20,
    ), raw


def overload(opts: CompareOptions, load: Load) -> dict[str, Any]:
    """Run the scenario (module docstring); returns per system its capacity and points, and whether the
    floods ran at real-time priority."""
    results: dict[str, Any] = {}
    reference: float | None = None
    first = 0
    for system in SYSTEMS:
        srv = system_server(system, opts)
        stem = opts.out / f"compare-overload-{system.name}"
        try:
            srv.start()
            wait_serving(srv, opts.ready_timeout_s)
            closed = flood(srv, stem.with_name(stem.name + "-capacity.json"), first=first, opts=opts, load=load,
                           callers=opts.concurrency)  # fmt: skip
            first += len(closed["requests"])
            capacity = sum(1 for r in closed["requests"] if r[1] == 200) / closed["span_s"]
            reference = reference or capacity
            points = []
            for m in load.multipliers:
                p, raw = point(srv, m * reference, m, reference, first=first, opts=opts, load=load, stem=stem)
                first += len(raw["requests"])
                points.append(asdict(p))
            results[system.name] = {"capacity": capacity, "points": points, "realtime": closed["realtime"]}
        finally:
            srv.stop()
    return {"reference_capacity": reference, "load": asdict(load), "systems": results}


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The printed table: one row per system and offered load, then the ratios at each load."""
    rows = [f"capacity (closed loop) {name} {s['capacity']:.2f}/s" for name, s in result["systems"].items()] + [
        f"{'system':8} {'load':>5} {'sent/s':>7} {'lag':>5} {'sent':>5} {'in time':>7} {'goodput':>7} "
        f"{'refused':>7} {'ref p50':>8} {'gave up':>7} {'err':>4} {'wasted':>6} {'RSS MiB':>8}"
    ]
    for name, s in result["systems"].items():
        for p in s["points"]:
            ref = "-" if p["refusal_p50_ms"] is None else f"{p['refusal_p50_ms']:.0f} ms"
            rows.append(
                f"{name:8} {p['multiplier']:4g}x {p['rate_sent']:7.2f} {p['lag_max_s']:4.2f}s {p['sent']:5d} "
                f"{p['answered']:7d} {p['goodput']:7.2f} {p['refused']:7d} {ref:>8} {p['gave_up']:7d} "
                f"{p['errors']:4d} {p['wasted_share']:6.0%} {p['rss_peak_mb']:8.0f}"
            )
    systems = result["systems"]
    if {"vlguard", "stock"} <= systems.keys():
        pairs = zip(systems["vlguard"]["points"], systems["stock"]["points"], strict=True)
        rows.append("goodput ratio vlguard/stock: " + ", ".join(
            f"{v['multiplier']:g}x {v['goodput'] / s['goodput']:.2f}" if s["goodput"] else f"{v['multiplier']:g}x n/a"
            for v, s in pairs))  # fmt: skip
    if not all(s["realtime"] for s in systems.values()):
        rows.append("the flood ran at normal priority (chrt -f was refused): check 'sent/s' against the plan")
    return rows
