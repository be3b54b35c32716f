"""The two-pass workload's request shapes and the benchmark report (pure: no server)."""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

import pytest
from PIL import Image

from server.serve import plugin_allowlist
from server.workload import report
from server.workload.cli import build_parser
from server.workload.generator import Record, TwoPassConfig, TwoPassPlan, error_kind


def _image_bytes(part: dict[str, object]) -> bytes:
    url = part["image_url"]["url"]  # type: ignore[index]
    assert isinstance(url, str) and url.startswith("data:image/png;base64,")
    return base64.b64decode(url.split(",", 1)[1])


def _text_len(messages: list[dict[str, object]]) -> int:
    total = 0
    for m in messages:
        content = m["content"]
        parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content]  # type: ignore[union-attr]
        total += sum(len(str(p).split()) for p in parts)
    return total


@pytest.fixture(scope="module")
def plan() -> TwoPassPlan:
    return TwoPassPlan(TwoPassConfig(seed=7, image_sizes=(64, 96), primary_words=10, rescue_words=30))


def test_image_is_last_in_the_user_turn_and_the_same_bytes_in_both_passes(plan: TwoPassPlan) -> None:
    for i in range(6):
        pair = plan.pair(i)
        first_turn = pair.primary[0]
        assert pair.primary[-1]["role"] == "user"
        assert [p["type"] for p in first_turn["content"]] == ["text", "image_url"]  # image last
        assert pair.rescue[0] == first_turn  # the rescue repeats the primary turn unchanged (cache prefix)
        assert _image_bytes(pair.primary[0]["content"][1]) == _image_bytes(pair.rescue[0]["content"][1]) == pair.image
        assert _text_len(pair.rescue) > _text_len(pair.primary)  # the rescue is longer


def test_the_plan_is_reproducible_and_images_differ_between_pairs(plan: TwoPassPlan) -> None:
    again = TwoPassPlan(plan.config)
    assert [again.pair(i) for i in range(4)] == [plan.pair(i) for i in range(4)]
    assert len({plan.pair(i).image for i in range(12)}) == 12  # no prefix-cache reuse across pairs
    other = TwoPassPlan(TwoPassConfig(seed=8, image_sizes=(64, 96), primary_words=10, rescue_words=30))
    assert [other.pair(i).primary for i in range(4)] != [plan.pair(i).primary for i in range(4)]


def test_image_sizes_and_prompt_lengths_follow_the_config(plan: TwoPassPlan) -> None:
    for i in range(8):
        pair = plan.pair(i)
        with Image.open(io.BytesIO(pair.image)) as img:
            assert max(img.size) == pair.image_side in (64, 96)
        assert len(pair.primary[0]["content"][0]["text"].split("Site notes: ", 1)[1].split()) == 10
        assert len(pair.rescue[1]["content"].split("Also consider: ", 1)[1].split()) == 30


def test_stream_share_is_respected() -> None:
    never = TwoPassPlan(TwoPassConfig(stream_share=0.0, image_sizes=(32,)))
    always = TwoPassPlan(TwoPassConfig(stream_share=1.0, image_sizes=(32,)))
    half = TwoPassPlan(TwoPassConfig(stream_share=0.5, image_sizes=(32,)))
    assert not any(any(never.pair(i).stream) for i in range(10))
    assert all(all(always.pair(i).stream) for i in range(10))
    streamed = sum(sum(half.pair(i).stream) for i in range(100))
    assert 70 < streamed < 130


def test_images_can_come_from_a_folder(tmp_path: Path) -> None:
    Image.new("RGB", (80, 40), "red").save(tmp_path / "a.png")
    Image.new("L", (40, 80)).save(tmp_path / "b.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    plan = TwoPassPlan(TwoPassConfig(image_dir=tmp_path, image_sizes=(50,)))
    assert {plan.pair(i).image_name for i in range(20)} == {"a.png", "b.jpg"}
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        TwoPassPlan(TwoPassConfig(image_dir=tmp_path / "empty"))


def _rec(ok: bool, e2e: float, ttft: float | None = None, error: str | None = None, stream: bool = False) -> Record:
    return Record(0, "primary", stream, 0.0, e2e, ttft, ok, error, prompt_tokens=90, completion_tokens=10)


def test_summary_counts_errors_by_kind_and_latency_percentiles() -> None:
    records = [_rec(True, 0.1 * (i + 1), ttft=0.01 * (i + 1), stream=True) for i in range(10)]
    records += [_rec(False, 1.0, error="http_500"), _rec(False, 1.0, error="connection", stream=True)]
    s = report.summarize(records, wall_s=2.0)
    assert (s["requests"], s["succeeded"], s["failed"]) == (12, 10, 2)
    assert s["errors"] == {"connection": 1, "http_500": 1}
    assert (s["failed_streaming"], s["failed_non_streaming"]) == (1, 1)
    assert s["tokens_per_s"] == pytest.approx(10 * 100 / 2.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(550.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(99.1)
    assert "http_500" in report.table({"x": s})


def test_ratios_divide_a_by_b_and_survive_empty_samples() -> None:
    fast = report.summarize([_rec(True, 0.1, ttft=0.02, stream=True)], wall_s=1.0)
    slow = report.summarize([_rec(True, 0.2, ttft=0.03, stream=True)], wall_s=2.0)
    r = report.ratios(fast, slow)
    assert r["throughput"] == pytest.approx(2.0)
    assert r["e2e_p50"] == pytest.approx(0.5)
    assert r["ttft_p50_diff_ms"] == pytest.approx(-10.0)
    empty = report.summarize([], wall_s=1.0)
    assert math.isnan(report.ratios(fast, empty)["ttft_p50"])


def test_intervals_cover_the_point_estimate_and_carry_the_drift_between_rounds() -> None:
    import numpy as np

    rng = np.random.default_rng(1)
    a = [list(0.100 + 0.05 * rng.random(8)) for _ in range(6)]
    b = [list(0.090 + 0.05 * rng.random(8)) for _ in range(6)]
    low, high = report.p50_diff_interval_ms(a, b)
    point = 1000 * (np.median(np.concatenate(a)) - np.median(np.concatenate(b)))
    assert low < point < high
    # A drift that hits both runs of a round alike barely widens it; one that hits one side does.
    drift = [0.0, 0.05, -0.03, 0.08, 0.02, -0.05]
    shared = report.p50_diff_interval_ms([[x + d for x in r] for r, d in zip(a, drift, strict=True)],
                                         [[x + d for x in r] for r, d in zip(b, drift, strict=True)])  # fmt: skip
    one_sided = report.p50_diff_interval_ms([[x + d for x in r] for r, d in zip(a, drift, strict=True)], b)
    assert one_sided[1] - one_sided[0] > 2 * (shared[1] - shared[0])
    assert all(math.isnan(x) for x in report.p50_diff_interval_ms(a[:1], b[:1]))
    assert all(math.isnan(x) for x in report.p50_diff_interval_ms([[], []], [[0.1], [0.2]]))
    # Throughput: paired rounds; a round's drift hits both sides, so the ratio stays tight.
    drift = [1.0, 0.5, 2.0, 0.8, 1.5]
    a_rounds = [(1100.0 * d, 1.0) for d in drift]
    b_rounds = [(1000.0 * d, 1.0) for d in drift]
    assert report.ratio_interval(a_rounds, b_rounds) == (pytest.approx(1.1), pytest.approx(1.1))
    assert all(math.isnan(x) for x in report.ratio_interval(a_rounds[:1], b_rounds[:1]))


def test_the_interval_over_server_pairs_carries_the_spread_between_pairs() -> None:
    # Two pairs at 1.1 and 0.9: a t interval with one degree of freedom spans far beyond both.
    low, high = report.pair_interval([1.1, 0.9], log=True)
    assert low < 0.9 and high > 1.1
    assert report.pair_interval([1.1, 0.9], log=True)[0] == pytest.approx(math.exp(-0.005 - 6.3138 * 0.10033), rel=1e-3)
    # Agreeing pairs: a narrow interval around them; identical ones: no width at all.
    low, high = report.pair_interval([1.01, 0.99, 1.00, 1.00, 1.02, 0.98])
    assert 0.98 < low < 1.0 < high < 1.02
    assert report.pair_interval([5.0, 5.0]) == (5.0, 5.0)
    assert all(math.isnan(x) for x in report.pair_interval([1.0]))
    assert all(math.isnan(x) for x in report.pair_interval([1.0, math.nan]))


def test_throughput_over_server_pairs_keeps_each_pairs_figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from contextlib import contextmanager

    from server.workload import compare
    from server.workload.generator import RunResult

    class FakeServer:
        def __init__(self, name: str) -> None:
            self.name, self.url = name, f"http://{name}"

        def resume(self) -> None: ...

        def pause(self) -> None: ...

    started: list[tuple[bool, bool]] = []
    sent: list[tuple[int, str, int]] = []
    reads: dict[str, int] = {}

    @contextmanager
    def running(opts: compare.CompareOptions, fresh: bool = True, reverse: bool = False):  # type: ignore[no-untyped-def]
        started.append((fresh, reverse))
        yield {"vlguard": FakeServer("vlguard"), "stock": FakeServer("stock"), "stock-b": FakeServer("stock-b")}

    def measure(srv: FakeServer, opts: compare.CompareOptions, first_pair: int, cpu: dict[str, float] | None = None):  # type: ignore[no-untyped-def]
        pair_no = len(started) - 1  # vlguard 1.1x stock's speed on the first pair, 0.9x on the second
        guarded = srv.name == "vlguard"  # stock-b (the A/A twin): 1.01x, then 0.99x
        speed = (1.1 if pair_no == 0 else 0.9) if guarded else 1.0
        speed = (1.01 if pair_no == 0 else 0.99) if srv.name == "stock-b" else speed
        recs = [Record(first_pair + i // 2, "primary", True, 0.0, 0.2, 0.110 if guarded else 0.100, True,
                       prompt_tokens=90, completion_tokens=10) for i in range(2 * opts.pairs)]  # fmt: skip
        if cpu is not None:  # API CPU: 3 ms a request on vlguard, 2 on stock
            cpu["api"] = cpu.get("api", 0.0) + (0.003 if guarded else 0.002) * len(recs)
        sent.append((pair_no, srv.name, first_pair))
        return RunResult(recs, wall_s=1.0 / speed)

    def counters(url: str) -> dict[str, float]:
        reads[url] = reads.get(url, 0) + 1
        return {"vllm:iteration_tokens_total_count": 10.0 * reads[url]}

    monkeypatch.setattr(compare, "_running", running)
    monkeypatch.setattr(compare, "_measure", measure)
    monkeypatch.setattr(compare, "_counters", counters)
    opts = compare.CompareOptions(model="m", out=tmp_path, trace=False, rounds=4, warmup=1, pairs=3, instances=2)
    result = compare.throughput(opts)

    assert started == [(True, False), (False, True)]  # later pairs append to the files; order swapped
    firsts = [first for _, name, first in sent if name == "stock"]
    assert firsts == [3 * i for i in range(10)]  # every round of every pair sends pairs of its own
    pairs = result["instances"]
    assert [p["throughput_ratio"] for p in pairs] == [pytest.approx(1.1), pytest.approx(0.9)]
    assert [p["ttft_p50_diff_ms"] for p in pairs] == [pytest.approx(10.0)] * 2
    assert [p["api_cpu_ratio"] for p in pairs] == [pytest.approx(1.5)] * 2
    low, high = result["throughput_ratio_ci90"]
    assert low < 0.9 and high > 1.1  # over the pairs, not the (steady) rounds
    assert result["api_cpu_ratio_ci90"] == (pytest.approx(1.5), pytest.approx(1.5))
    assert result["cpu_ms_per_request"]["vlguard"]["api"] == pytest.approx(3.0)
    assert result["summaries"]["stock"]["requests"] == 2 * 4 * 2 * 3
    assert result["counters"]["stock"]["vllm:iteration_tokens_total_count"] == 20.0  # 10 per pair, summed
    # the A/A floor from the same rounds: stock-b against stock (TTFT and API CPU equal to stock's)
    floor = result["floor"]
    assert [p["throughput_ratio"] for p in floor["instances"]] == [pytest.approx(1.01), pytest.approx(0.99)]
    assert floor["ttft_p50_diff_ci90_ms"] == (pytest.approx(0.0), pytest.approx(0.0))
    assert result["verdict"]["ttft_p50"] == "outside it, by +10.0 ms"
    assert result["verdict"]["api_cpu"] == "outside it, by +50.0 %"
    order = [name for pair_no, name, first in sent if pair_no == 0 and first in (3, 6)]
    assert order == ["vlguard", "stock", "stock-b", "stock", "stock-b", "vlguard"]  # rotated every round


def test_a_figure_is_judged_against_the_aa_interval() -> None:
    from server.workload.compare import floor_verdict

    assert floor_verdict(1.01, (0.97, 1.03)) == "within the floor"
    assert floor_verdict(0.95, (0.97, 1.03)) == "outside it, by -2.0 %"
    assert floor_verdict(12.0, (-4.0, 5.0), " ms") == "outside it, by +7.0 ms"
    assert floor_verdict(1.0, (math.nan, math.nan)).startswith("not resolved")


def test_ttft_phases_split_the_client_ttft_at_the_engine_client() -> None:
    records = [_rec(True, 0.2, ttft=0.05, stream=True), _rec(True, 0.2, ttft=0.07, stream=True), _rec(True, 0.3)]
    counters = {"vllm:time_to_first_token_seconds_sum": 0.12, "vllm:time_to_first_token_seconds_count": 3,
                "vllm:request_queue_time_seconds_sum": 0.03, "vllm:request_queue_time_seconds_count": 3}  # fmt: skip
    phases = report.phases_ms(records, counters)
    assert phases["client_ttft"] == pytest.approx(60.0)
    assert (phases["vllm_ttft"], phases["queued"]) == (pytest.approx(40.0), pytest.approx(10.0))
    assert phases["front"] == pytest.approx(20.0)
    assert math.isnan(phases["prefill"])  # no sample: not zero


def test_error_kinds_are_named_from_the_openai_client_exceptions() -> None:
    import httpx
    import openai

    req = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    assert error_kind(openai.APIConnectionError(request=req)) == "connection"
    assert error_kind(openai.APITimeoutError(request=req)) == "timeout"
    resp = httpx.Response(503, request=req)
    assert error_kind(openai.APIStatusError("busy", response=resp, body=None)) == "http_503"
    assert error_kind(openai.APIError("boom", request=req, body=None)) == "stream_error"


def test_bench_arguments_are_validated() -> None:
    parser = build_parser()
    args = parser.parse_args(["twopass", "--duration", "5", "--image-sizes", "224,448"])
    assert args.duration == 5.0 and args.image_sizes == (224, 448)
    for bad in (["twopass", "--stream-share", "1.5"], ["twopass", "--image-sizes", "8"],
                ["twopass", "--pairs", "3", "--duration", "2"], ["compare", "m", "--scenario", "nope"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_vlguard_plugins_stay_allowed_when_the_user_restricts_vllm_plugins() -> None:
    assert plugin_allowlist(None) is None  # unset: vLLM loads every installed plugin
    assert plugin_allowlist("") == "vlguard_patches,vlguard_fatal,vlguard_parent_watch,vlguard_replay_cache"
    assert (
        plugin_allowlist("mine, vlguard_fatal")
        == "mine,vlguard_fatal,vlguard_patches,vlguard_parent_watch,vlguard_replay_cache"
    )


def test_the_compare_waits_for_a_spare_only_where_vlguard_keeps_one() -> None:
    from server.workload.compare import keeps_spare
    from server.workload.servers import ServerProcess

    def srv(*args: str, **env: str) -> ServerProcess:
        return ServerProcess(["vlguard", "serve", "m", *args], Path("unused.log"), env=env)

    assert keeps_spare(srv()) and keeps_spare(srv("--guard-spare", "on", VLGUARD_SPARE="off"))
    assert not keeps_spare(srv(VLGUARD_SPARE="off")) and not keeps_spare(srv("--guard-spare", "off"))


def test_the_overhead_scenarios_stock_side_runs_no_vlguard_plugin_but_the_tracer(tmp_path: Path) -> None:
    from server.vllm_hooks.processor_cache import ENV
    from server.workload.compare import SCENARIOS, CompareOptions, system_server

    opts = CompareOptions(model="m", scenario="overhead", out=tmp_path)
    guarded, stock, twin = (system_server(system, opts) for system in SCENARIOS["overhead"])
    assert twin.env["VLLM_PLUGINS"] == "vlguard_phase_trace" and twin.log_path != stock.log_path  # the A/A floor's twin
    assert "vllm.entrypoints.openai.api_server" in " ".join(stock.argv)
    from server.workload.servers import stock_command

    assert "server.workload.stock_serve" in stock_command("m", "--api-server-count", "2")  # vllm serve's launcher
    assert stock.env["VLLM_PLUGINS"] == "vlguard_phase_trace" and ENV not in stock.env  # vLLM's own split cache
    # both sides traced, each to its own file; --no-trace: neither
    assert guarded.env["VLGUARD_PHASE_TRACE"] != stock.env["VLGUARD_PHASE_TRACE"]
    untraced = system_server(
        SCENARIOS["overhead"][1], CompareOptions(model="m", scenario="overhead", out=tmp_path, trace=False)
    )
    assert untraced.env["VLLM_PLUGINS"] == "" and "VLGUARD_PHASE_TRACE" not in untraced.env


def test_front_ratio_and_added_cpu_come_from_paired_rounds() -> None:
    """``--scenario front``: per-round ratios (geometric mean, t interval) and added ms per request."""
    from server.workload.front import FrontResult

    result = FrontResult(cpu_ms={"stock-a": [10.0, 20.0, 10.0], "vlguard": [11.0, 22.0, 11.0]})
    ratio, (low, high) = result.ratio("vlguard", "stock-a")
    assert abs(ratio - 1.1) < 1e-9 and abs(low - 1.1) < 1e-9 and abs(high - 1.1) < 1e-9  # no spread: exact
    added, (dlow, dhigh) = result.added_ms("vlguard", "stock-a")
    assert abs(added - 4 / 3) < 1e-9 and dlow < added < dhigh
    # the front's throughput the same way: requests served per second of each block
    result.rps = {"stock-a": [40.0, 50.0], "vlguard": [36.0, 45.0]}
    assert result.ratio("vlguard", "stock-a", of="rps")[0] == pytest.approx(0.9)
    # and the event-loop threads' part of the CPU
    result.loop_cpu_ms = {"stock-a": [3.0, 4.0], "vlguard": [3.3, 4.0]}
    assert result.added_ms("vlguard", "stock-a", of="loop_cpu_ms")[0] == pytest.approx(0.15)


def test_a_process_cpu_is_split_into_its_main_thread_and_the_rest() -> None:
    """The front scenario reads a server's event-loop thread (its main thread) apart from vLLM's workers."""
    import subprocess as sp
    import sys as system

    from server.workload.front import _cpu_s

    spin = "import threading,time\ndef s():\n  t=time.thread_time()+0.3\n  while time.thread_time()<t: pass\n"
    code = spin + "th=threading.Thread(target=s); th.start(); th.join(); print('done', flush=True); time.sleep(30)"
    proc = sp.Popen([system.executable, "-c", code], stdout=sp.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"done\n"
        total, main = _cpu_s([proc])
        # The spinning worker thread (0.3 s of its own clock) is not the main thread (its imports); the
        # kernel counts threads' CPU in clock ticks (10 ms here): a CI run read 0.2999... for 0.3.
        assert total - main >= 0.25 and main < total - main
    finally:
        proc.kill()
        proc.wait()


def test_front_takes_the_api_server_count_out_of_the_serve_flags() -> None:
    """The front scenario starts N API processes per system itself (``vlguard serve`` refuses N > 1)."""
    from server.workload.front import api_server_count

    flags = ["--config", "c.yaml", "--api-server-count", "2", "--port", "1"]
    assert api_server_count(flags) == (2, ["--config", "c.yaml", "--port", "1"])
    assert api_server_count(["-asc", "3"]) == (3, [])
    assert api_server_count(["--api-server-count=4", "--max-num-seqs", "8"]) == (4, ["--max-num-seqs", "8"])
    assert api_server_count(["--config", "c.yaml"]) == (1, ["--config", "c.yaml"])
    assert api_server_count(["--api-server"]) == (1, ["--api-server"])  # no abbreviations taken
    with pytest.raises(ValueError, match="at least 1"):
        api_server_count(["--api-server-count", "0"])


def test_engine_step_cost_is_per_step_and_paired_by_round(plan: TwoPassPlan) -> None:
    from server.workload.engine_step import EngineStepResult, _hf_messages

    # the two-pass messages as chat-template messages: one image placeholder per image part
    rescue, images = _hf_messages(plan.pair(0).rescue)
    assert images == 1 and rescue[0]["content"][-1] == {"type": "image"}
    # (steps, CPU s, thread CPU s, wall s) per round: vlguard 2 % more CPU per step than stock-a in every round
    result = EngineStepResult(
        {
            "stock-a": [(100, 1.0, 0.5, 2.0), (120, 1.3, 0.6, 2.5)],
            "vlguard": [(100, 1.02, 0.5, 2.0), (120, 1.326, 0.6, 2.5)],
            "stock-b": [(100, 1.0, 0.5, 2.0), (120, 1.3, 0.6, 2.5)],
        }
    )
    assert result.per_step_ms("stock-a", 1) == pytest.approx(1000 * 2.3 / 220)
    ratio, (low, high) = result.ratio("vlguard", "stock-a")
    assert ratio == pytest.approx(1.02) and low == pytest.approx(1.02) and high == pytest.approx(1.02)
    assert result.ratio("stock-b", "stock-a", 3)[0] == pytest.approx(1.0)


def test_scale_runs_report_the_drain_after_the_fault_point() -> None:
    from server.workload.scale import ScaleRun, summary_lines

    def run(drain: float, failed: int) -> ScaleRun:
        summary = {"failed_non_streaming": failed, "failed_streaming": 0, "requests": 32}
        return ScaleRun(8, 1.0, 8, drain, summary, 1000.0, 1100.0, {"vlguard_engine_restarts_total": 1.0})

    lines = summary_lines({"kind": "kill", "sizes": {8: {"uninterrupted": run(1.0, 0), "faulted": run(7.5, 1)}}})
    assert lines[-1] == "| 8 (8) | 1.0 | 7.5 | +6.5 | 1 / 0 of 32 | 1000 -> 1100; 1000 -> 1100 | restarts_total 1 |"
