"""``vlguard bench``: the two-pass generator against the real server, and a short side-by-side compare
of vlguard and the stock vLLM server (both started by the command). Asserts that things ran and files are
valid, never timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from server.workload import phase_trace, report
from tests.servers import NO_COMPILE_WHEN_EAGER, NO_SPARE, REPO, TINY_PROFILE, ServerProcess


def _bench(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``vlguard bench ARGS``; the servers it starts are eager, so both get :data:`NO_COMPILE_WHEN_EAGER`,
    and vlguard keeps no spare (:data:`NO_SPARE`: the harness is under test, not the spare)."""
    proc = subprocess.run(
        [sys.executable, "-m", "server", "bench", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False,
        env={**os.environ, **NO_COMPILE_WHEN_EAGER, **NO_SPARE},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _assert_png(path: Path) -> None:
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 400 and img.height > 200


def test_twopass_run_completes_without_errors_and_writes_json_and_png(server: ServerProcess, tmp_path: Path) -> None:
    proc = _bench("twopass", "--url", server.url, "--pairs", "4", "--concurrency", "2", "--image-sizes", "224,320",
                  "--max-tokens", "8", "--seed", "3", "--out", str(tmp_path), "--no-progress",
                  timeout_s=300)  # fmt: skip
    assert "server" in proc.stdout and "TTFT p50" in proc.stdout
    data = json.loads((tmp_path / "twopass.json").read_text())
    summary, records = data["summary"], data["records"]
    assert (summary["requests"], summary["failed"], summary["errors"]) == (8, 0, {})
    assert sorted(r["kind"] for r in records) == ["primary"] * 4 + ["rescue"] * 4
    assert all(r["completion_tokens"] == 8 for r in records)  # EOS ignored: fixed work per request
    for pair in range(4):  # the rescue shares the primary's prefix and adds to it
        primary, rescue = (
            next(r for r in records if r["pair"] == pair and r["kind"] == k) for k in ("primary", "rescue")
        )
        assert rescue["prompt_tokens"] > primary["prompt_tokens"]
        assert rescue["start_s"] >= primary["start_s"] + primary["e2e_s"]  # sent after the primary answered
    streamed = [r for r in records if r["stream"]]
    assert streamed and all(r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["e2e_s"] for r in streamed)
    assert summary["tokens_per_s"] > 0 and summary["e2e_ms"]["p50"] > 0
    _assert_png(tmp_path / "twopass-latency.png")


#: a traced request's points in the order it passes them (report.TRACE_PHASES and GUARD_TRACE_PHASES)
ORDER = ("asgi", "input_guard", "checks", "checked", "admission", "handler", "rendered", "guard", "submit", "output",
         "guard_out", "chunk", "sent", "first_token")  # fmt: skip


def test_compare_runs_vlguard_and_stock_side_by_side_and_prints_ratios(tiny_model: Path, tmp_path: Path) -> None:
    """The overhead scenario's harness on two real servers (``--no-floor``: a third, the A/A twin, cost ~25 s
    of CI; the floor's figures and verdicts are unit-tested over the three systems, test_workload.py)."""
    proc = _bench("compare", str(tiny_model), "--rounds", "2", "--warmup", "0", "--pairs", "2", "--concurrency", "2",
                  "--max-tokens", "4", "--out", str(tmp_path), "--no-progress", "--no-floor",
                  "--", "--config", str(TINY_PROFILE), "--enforce-eager", timeout_s=900)  # fmt: skip
    assert "ratios vlguard/stock: throughput" in proc.stdout
    data = json.loads((tmp_path / "compare-overhead.json").read_text())
    assert "floor" not in data  # two servers, not three
    for name in ("vlguard", "stock"):
        assert (data["summaries"][name]["requests"], data["summaries"][name]["failed"]) == (8, 0), name
    assert all(math.isfinite(v) for v in data["ratios"].values()), data["ratios"]
    assert len(data["round_throughput_ratios"]) == 2
    low, high = data["throughput_ratio_ci90"]  # two rounds resampled in pairs
    assert low <= min(data["round_throughput_ratios"]) + 1e-9 and high >= max(data["round_throughput_ratios"]) - 1e-9
    # Both did the work; only vlguard exports vlguard's metrics (stock runs without vlguard's plugins).
    assert data["counters"]["vlguard"]["vllm:iteration_tokens_total_count"] > 0
    assert data["counters"]["stock"]["vllm:iteration_tokens_total_count"] > 0
    assert not [k for k in data["counters"]["stock"] if k.startswith("vlguard_")]
    assert "vlguard_deepstack_padded_reads_total" in data["counters"]["vlguard"]
    for side in ("vlguard", "stock"):  # both API processes and engine cores did measurable work
        assert data["cpu_ms_per_request"][side]["api"] > 0 and data["cpu_ms_per_request"][side]["engine_core"] > 0
        phases = data["ttft_phases_ms"][side]  # vLLM's TTFT histograms counted the measured requests
        assert phases["vllm_ttft"] > 0 and phases["prefill"] > 0 and math.isfinite(phases["front"]), phases
        # #16: both servers' tracers stamped every point of every streamed request, in order, and the
        # phases add up to the client's TTFT
        traced = data["ttft_trace_ms"][side]
        assert [name for name, _, _ in report.TRACE_PHASES] == list(traced)[: len(report.TRACE_PHASES)], traced
        assert len({t["n"] for t in traced.values()}) == 1 and all(t["p50"] >= 0 for t in traced.values()), traced
        total = sum(traced[name]["mean"] for name, _, _ in report.TRACE_PHASES)
        assert total == pytest.approx(phases["client_ttft"], abs=0.01), (total, phases)
        guard = [name for name, _, _ in report.GUARD_TRACE_PHASES]
        assert all(name in traced for name in guard) == (side == "vlguard"), traced
        # every streamed request traced, its points in request order on the one clock the client shares
        streamed = [r for r in data["records"][side] if r["stream"] and r["ok"]]
        assert traced["connect"]["n"] == len(streamed) > 0
        events = phase_trace.read(tmp_path / f"compare-overhead-{side}-trace.jsonl")
        for rec in streamed:
            points = {**events[rec["trace_id"]], "first_token": rec["sent_at"] + rec["ttft_s"]}
            times = [rec["sent_at"], *(points[p] for p in ORDER if p in points)]
            assert times == sorted(times), (side, points)
    assert "TTFT phase (streamed requests)" in proc.stdout
    assert "vlguard's own code on the way to the first token" in proc.stdout
    _assert_png(tmp_path / "compare-overhead-latency.png")


def test_front_scenario_measures_both_apps_and_vlguards_own_code(tiny_model: Path, tmp_path: Path) -> None:
    """``--scenario front`` (no engine core: the API processes over the null engine), with
    ``--api-server-count 2`` as ``vllm serve`` takes it: two processes per system on one socket, every
    request served, the ratios finite, and vlguard's own code found in its processes' phase traces (door,
    engine client), which a change to how the front process is assembled once left silently empty."""
    proc = _bench("compare", str(tiny_model), "--scenario", "front", "--rounds", "2", "--warmup", "0",
                  "--pairs", "3", "--concurrency", "2", "--out", str(tmp_path), "--no-progress",
                  "--", "--config", str(TINY_PROFILE), "--api-server-count", "2", timeout_s=600)  # fmt: skip
    assert "vlguard/stock" in proc.stdout and "own code" in proc.stdout, proc.stdout[-2000:]
    data = json.loads((tmp_path / "compare-front.json").read_text())
    assert set(data["failed"].values()) == {0}, data["failed"]
    assert data["api_servers"] == 2 and "front throughput (2 API processes)" in proc.stdout
    # Two processes of each system served on the one socket (which of them takes a connection is the
    # kernel's choice, as for vLLM's API servers: the test's two connections may both reach one)
    for system in ("stock-a", "vlguard", "stock-b"):
        assert all((tmp_path / f"compare-front-{system}-{i}.ready").exists() for i in (0, 1)), system
    assert sum((tmp_path / f"compare-front-vlguard-{i}-trace.jsonl").read_text().count("\n") for i in (0, 1)) > 0
    ratio, (low, high) = data["ratio"]
    assert 0 < low <= ratio <= high and math.isfinite(high), data["ratio"]
    rps, (low, high) = data["rps_ratio"]
    assert 0 < low <= rps <= high and math.isfinite(high) and "front throughput" in proc.stdout, data["rps"]
    # The event-loop threads' part, each round's below the whole process's
    loop, (low, high) = data["loop_ratio"]
    assert 0 < low <= loop <= high and math.isfinite(high) and "event-loop CPU ratio" in proc.stdout, data
    for system, rounds in data["loop_cpu_ms"].items():
        assert all(0 < x < y for x, y in zip(rounds, data["cpu_ms"][system], strict=True)), system
    # vlguard's own phases, and the parts of them shown on their own (the parse, the image cache shadow)
    mine = set(report.GUARD_SHOWN_PHASES)
    assert set(data["own_ms"]) == mine, data["own_ms"]
    assert "added by vlguard" in proc.stdout
    # Their CPU, from the same points: never above their time (the waits are left out)
    assert set(data["own_cpu_ms"]) == mine, data["own_cpu_ms"]
    for name, cpu in data["own_cpu_ms"].items():
        assert 0 <= cpu["p50"] <= data["own_ms"][name]["p50"] + 1e-3, (name, cpu, data["own_ms"][name])
