"""``vlguard bench compare --scenario kill|fault --in-flight 8,64,256``: the guard's recovery as load grows.

One vlguard server. For each load size N the two-pass workload runs twice on fresh pairs: uninterrupted,
then with the fault. A run is 2N pairs with N of them in flight (each pair's rescue sent when its primary
answered, half of the requests streamed), so N requests are in flight from the start until the last
pairs drain. The fault comes when the N-th request succeeded:

- ``kill``: SIGKILL of the real ``VLLM::EngineCore`` process (vlguard rebuilds; with its spare engine
  process ready, as hours after start-up);
- ``fault``: one request holding the test fault plugin's marker (``tests/plugins``, development
  environments only) makes the model step it is scheduled in raise, as a poison input does (soft
  recovery). The uninterrupted run sends the same request without the marker at the same point.

Reported per N: requests in flight at the fault, seconds from the fault point until the last request
completed (uninterrupted and faulted, and the difference), load requests failed (goal 0; the poison
request is not one of them), the API process's peak resident memory in each run, and the recoveries
the server counted. The stock server is not run here: it loses every request in flight on either
fault (the ``kill`` and ``fault`` scenarios without ``--in-flight`` show that at small loads).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from server.workload import faults, generator, report
from server.workload.compare import CompareOptions, System, system_server, wait_serving
from server.workload.servers import ServerProcess, metric_samples, rss_peak

#: The counters whose deltas over a run are reported (keyed by their ``kind`` label where they have one).
RECOVERY_COUNTERS = ("vlguard_engine_recoveries_total", "vlguard_engine_restarts_total")


@dataclass
class ScaleRun:
    """One run at one load size. Times are seconds on the run's clock (from its start)."""

    in_flight: int
    fault_at_s: float | None = None
    in_flight_at_fault: int = 0
    drain_s: float | None = None  # from the fault point until the last load request completed
    summary: dict[str, Any] = field(default_factory=dict)
    api_rss_start_mb: float = 0.0  # before the run: the processor cache grows over the runs (fresh images)
    api_rss_peak_mb: float = 0.0
    recoveries: dict[str, float] = field(default_factory=dict)
    side_request: int | None = None  # the marker (or harmless) request's HTTP status; 0: no answer


def _poison_body(model: str, n: int, marked: bool) -> dict[str, Any]:
    text = f"Scale run {n}:{faults.MARKER if marked else ' Plain words here'} now."
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


async def _side_request(url: str, body: dict[str, Any]) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        try:
            return (await client.post("/v1/chat/completions", json=body)).status_code
        except httpx.HTTPError:
            return 0


async def _run(srv: ServerProcess, opts: CompareOptions, kind: str, n: int, first_pair: int, faulted: bool) -> ScaleRun:
    plan = generator.TwoPassPlan(opts.workload)
    async with httpx.AsyncClient(timeout=30) as client:
        model = (await client.get(srv.url + "/v1/models")).json()["data"][0]["id"]
    run = ScaleRun(in_flight=n)
    state: dict[str, float] = {"succeeded": 0}
    side: list[asyncio.Task[int]] = []

    def on_record(rec: generator.Record) -> None:
        state["succeeded"] += rec.ok
        if "at" in state or state["succeeded"] < n:
            return
        state["at"] = time.monotonic()
        if kind == "kill" and faulted:
            srv.engine_core().kill()  # SIGKILL
        elif kind == "fault":
            body = _poison_body(model, first_pair, marked=faulted)
            side.append(asyncio.get_running_loop().create_task(_side_request(srv.url, body)))

    before = metric_samples(srv.url, *RECOVERY_COUNTERS, by_label="kind")
    assert srv.proc is not None
    run.api_rss_start_mb = psutil.Process(srv.proc.pid).memory_info().rss / 2**20
    with rss_peak(srv.proc.pid) as peak:
        res = await generator.run(srv.url, plan, pairs=2 * n, first_pair=first_pair, concurrency=n, model=model,
                                  progress=opts.progress, on_record=on_record)  # fmt: skip
        run.side_request = await side[0] if side else None
    after = metric_samples(srv.url, *RECOVERY_COUNTERS, by_label="kind")
    run.api_rss_peak_mb = peak[0] / 2**20
    run.recoveries = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    run.summary = report.summarize(res.records, res.wall_s)
    if "at" in state:
        at = run.fault_at_s = state["at"] - res.started_at
        run.in_flight_at_fault = sum(1 for r in res.records if r.start_s <= at < r.start_s + r.e2e_s)
        run.drain_s = max(r.start_s + r.e2e_s for r in res.records) - at
    return run


def scale(opts: CompareOptions, kind: str, sizes: tuple[int, ...]) -> dict[str, Any]:
    """Run the scale scenario (module docstring) for ``kind`` (``"kill"`` or ``"fault"``) at each load
    size in ``sizes``; returns per size the uninterrupted and the faulted :class:`ScaleRun`."""
    if kind not in ("kill", "fault"):
        raise ValueError(f"no scale run for scenario {kind!r}")
    env = faults.fault_env(opts.model) if kind == "fault" else None
    srv = system_server(System("vlguard"), opts, extra_env=env)
    results: dict[int, dict[str, ScaleRun]] = {}
    first_pair = 0
    try:
        srv.start()
        wait_serving(srv, opts.ready_timeout_s)
        for n in sizes:
            runs = {}
            for name, faulted in (("uninterrupted", False), ("faulted", True)):
                runs[name] = asyncio.run(_run(srv, opts, kind, n, first_pair, faulted))
                first_pair += 2 * n  # fresh pairs every run: no prefix-cache hits from an earlier one
                wait_serving(srv, opts.ready_timeout_s)
            results[n] = runs
    finally:
        srv.stop()
    return {"kind": kind, "sizes": results}


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The printed table: one row per load size."""
    lines = [
        f"{result['kind']} at scale: seconds from the fault until every request completed",
        "| in flight (at fault) | uninterrupted | faulted | added | failed: non-streaming / streaming "
        "| API RSS MiB at start -> peak: uninterrupted; faulted | recoveries |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, runs in result["sizes"].items():
        u, f = runs["uninterrupted"], runs["faulted"]
        added = f.drain_s - u.drain_s if f.drain_s is not None and u.drain_s is not None else float("nan")
        rec = ", ".join(f"{k.removeprefix('vlguard_engine_')} {v:g}" for k, v in sorted(f.recoveries.items()))
        lines.append(
            f"| {n} ({f.in_flight_at_fault}) | {u.drain_s or float('nan'):.1f} | {f.drain_s or float('nan'):.1f} "
            f"| {added:+.1f} | {f.summary['failed_non_streaming']} / {f.summary['failed_streaming']} of "
            f"{f.summary['requests']} | {u.api_rss_start_mb:.0f} -> {u.api_rss_peak_mb:.0f}; "
            f"{f.api_rss_start_mb:.0f} -> {f.api_rss_peak_mb:.0f} | {rec or 'none'} |"
        )
    return lines
