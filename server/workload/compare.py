"""``vlguard bench compare``: two systems on the same machine, model and engine arguments, in one run.

Scenarios (systems A / B; every ratio printed is A / B):

- ``overhead``: vlguard vs the stock vLLM OpenAI server (wrapper cost), with a second stock server run in
  the same rounds: its figures against the first are the A/A floor of this very run, and the result
  says whether vlguard's lie within it (``floor``, ``verdict``).
- ``alignment``: vlguard with chunk alignment on vs off (deepstack patches as detected on both).
- ``patches``: vlguard with the deepstack backports on vs off.
- ``noise``: stock vs stock (an A/A run): how far the figures move between two identical systems on this
  machine, the floor under any of the other scenarios' goals.
- ``kill``: vlguard vs stock, each SIGKILLed in its ``VLLM::EngineCore`` after ``kill_after`` successful
  requests. The stock server exits on engine death; the harness starts it again at once, as systemd's
  ``Restart=always`` would, so its recovery includes the cold start.
- ``fault`` (:mod:`server.workload.faults`): a step fault every few seconds; vlguard with soft recovery,
  vlguard rebuilding, stock restarted.

Throughput scenarios rotate the order every round (A B, B A, ...; with three systems A B C, B C A, C A B).
Each round sends the same fresh pairs to every system (new images every round: no cache reuse across
rounds) and the servers not being measured are SIGSTOPped, so their idle engine and OpenMP threads take
no cores from the one being measured. Besides the aggregate ratios, the median of per-round throughput
ratios is printed: a round's runs are adjacent in time, which cancels most of a noisy machine's drift.
``instances`` > 1 repeats the whole thing on fresh server sets (all started at once; the order they are
waited on and paused in is reversed each time): two identically built servers differ by several percent
here for a whole run, a spread no number of rounds on one set averages out, so the intervals are then
taken over the sets.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server.workload import generator, phase_trace, report
from server.workload.servers import ServerProcess, engine_env, metric_samples, stock_command, vlguard_command


@dataclass(frozen=True)
class System:
    """One side of a comparison: stock vLLM or vlguard with extra ``--guard-*`` flags."""

    name: str
    stock: bool = False
    guard_args: tuple[str, ...] = ()


SCENARIOS: dict[str, tuple[System, ...]] = {
    # the second stock server is the A/A floor, measured in the same rounds (throughput: floor, verdict)
    "overhead": (System("vlguard"), System("stock", stock=True), System("stock-b", stock=True)),
    "alignment": (
        System("aligned", guard_args=("--guard-alignment", "on")),
        System("unaligned", guard_args=("--guard-alignment", "off")),
    ),
    "patches": (
        System("patched", guard_args=("--guard-patches", "on")),
        System("unpatched", guard_args=("--guard-patches", "off")),
    ),
    "kill": (System("vlguard"), System("stock", stock=True)),
    "noise": (System("stock-a", stock=True), System("stock-b", stock=True)),
}

#: Counters read from each server's /metrics before and after the measured rounds (their deltas are reported).
COUNTERS = (
    "vllm:iteration_tokens_total_count",
    "vlguard_alignment_steps_total",
    "vlguard_alignment_recomputed_tokens_total",
    "vlguard_alignment_deferred_tokens_total",
    "vlguard_deepstack_padded_reads_total",
    "vlguard_engine_deaths_total",
    "vllm:prefix_cache_queries",  # tokens looked up in / found in the prefix cache (the rescue pass's hits)
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
)
#: the ``_sum`` and ``_count`` samples of vLLM's TTFT phase histograms (:data:`report.TTFT_PHASES`)
PHASE_SAMPLES = tuple(name + suffix for name in report.TTFT_PHASES.values() for suffix in ("_sum", "_count"))


@dataclass
class CompareOptions:
    """What ``vlguard bench compare`` was asked for (see its ``--help``)."""

    model: str
    scenario: str = "overhead"
    serve_args: tuple[str, ...] = ()
    workload: generator.TwoPassConfig = field(default_factory=generator.TwoPassConfig)
    rounds: int = 6
    warmup: int = 1
    pairs: int = 8
    instances: int = 1  # server pairs, started one after the other (throughput scenarios)
    concurrency: int = 4
    kill_after: int = 10
    fault_every_s: float = 10.0
    fault_duration_s: float = 40.0
    emulate_padding: bool = False
    out: Path = Path("bench-out")
    progress: bool = True
    ready_timeout_s: float = 900.0
    trace: bool = True  # the phase trace in both servers (server.workload.phase_trace)
    floor: bool = True  # the scenario's A/A twin of its reference (overhead: a second stock server)


def systems(opts: CompareOptions) -> tuple[System, ...]:
    """The systems ``opts`` compares: its scenario's (:data:`SCENARIOS`), the A/A twin (the third) left out
    without ``opts.floor``."""
    return SCENARIOS[opts.scenario] if opts.floor else SCENARIOS[opts.scenario][:2]


def trace_path(system: System, opts: CompareOptions) -> Path:
    """Where the server of ``system`` writes its phase trace (:mod:`server.workload.phase_trace`)."""
    return opts.out / f"compare-{opts.scenario}-{system.name}-trace.jsonl"


def system_server(
    system: System,
    opts: CompareOptions,
    extra_env: dict[str, str] | None = None,
    stock_plugins: str = "",
    fresh: bool = True,
) -> ServerProcess:
    """The (not yet started) server of one side, its phase tracer on with ``opts.trace``
    (:func:`trace_path`). ``extra_env`` goes to every side; ``stock_plugins`` is the stock server's
    ``VLLM_PLUGINS`` besides the tracer (none by default: vlguard's plugins, installed in the same
    environment, stay out of stock). ``fresh``: its log and trace files start empty (else they are
    appended to: a later server pair of the same run)."""
    log = opts.out / f"compare-{opts.scenario}-{system.name}.log"
    if fresh:
        log.write_bytes(b"")
    traced = {}
    if opts.trace:
        trace = trace_path(system, opts)
        if fresh:
            trace.write_bytes(b"")
        traced = {phase_trace.ENV: str(trace)}
    extra_env = {**traced, **(extra_env or {})}
    if system.stock:
        plugins = ",".join(p for p in (stock_plugins or "", "vlguard_phase_trace" if opts.trace else "") if p)
        env = engine_env(VLLM_PLUGINS=plugins, **extra_env)
        return ServerProcess(stock_command(opts.model, *opts.serve_args), log, env=env, ready_path="/health")
    args = [*opts.serve_args, *system.guard_args]
    env = engine_env(**extra_env)
    if opts.emulate_padding:  # the test-only plugin in tests/plugins (development environments)
        env["VLGUARD_TEST_EMULATE_PADDING"] = "1"
        args += ["--guard-alignment-max-capture-size", "512"]
    return ServerProcess(vlguard_command(opts.model, *args), log, env=env)


@contextmanager
def _running(opts: CompareOptions, fresh: bool = True, reverse: bool = False) -> Iterator[dict[str, ServerProcess]]:
    """Every system of the scenario started (concurrently), ready and paused; stopped on exit.
    ``reverse``: they are waited on and paused in reverse order (they still boot at the same time).
    vlguard is paused once its spare engine process is ready too (its imports would otherwise run inside
    the measured load). ``fresh``: as for :func:`system_server`."""
    started = systems(opts)
    servers = {s.name: system_server(s, opts, fresh=fresh) for s in started}
    order = [servers[s.name] for s in (started[::-1] if reverse else started)]
    try:
        for srv in order:
            srv.start()
        for srv in order:
            wait_serving(srv, opts.ready_timeout_s)
            srv.pause()
        yield servers
    finally:
        with ThreadPoolExecutor(len(servers)) as pool:  # each stop waits seconds for its engine processes
            list(pool.map(lambda srv: srv.stop(), servers.values()))


def _counters(url: str) -> dict[str, float]:
    return metric_samples(url, *COUNTERS, *PHASE_SAMPLES, by_label="outcome")


def _measure(
    srv: ServerProcess, opts: CompareOptions, first_pair: int, cpu: dict[str, float] | None = None
) -> generator.RunResult:
    """One round on ``srv``; adds the CPU seconds each process role used in it to ``cpu`` when given."""
    plan = generator.TwoPassPlan(opts.workload)
    before = srv.cpu_seconds()
    srv.resume()
    try:
        return asyncio.run(
            generator.run(
                srv.url,
                plan,
                pairs=opts.pairs,
                first_pair=first_pair,
                concurrency=opts.concurrency,
                progress=opts.progress,
                trace=opts.trace,
            )
        )
    finally:
        srv.pause()
        if cpu is not None:
            for role, used in srv.cpu_seconds().items():
                cpu[role] = cpu.get(role, 0.0) + used - before.get(role, 0.0)


def _ttfts(records: list[generator.Record]) -> list[float]:
    return [r.ttft_s for r in records if r.ok and r.ttft_s is not None]


def _pair_intervals(per_instance: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """90 % t intervals over the server pairs' figures (:func:`_instance_summary`)."""
    return {
        "throughput_ratio_ci90": report.pair_interval([i["throughput_ratio"] for i in per_instance], log=True),
        "ttft_p50_diff_ci90_ms": report.pair_interval([i["ttft_p50_diff_ms"] for i in per_instance]),
        "api_cpu_ratio_ci90": report.pair_interval([i["api_cpu_ratio"] for i in per_instance], log=True),
    }


@dataclass
class _Tally:
    """One system's measured rounds, over every server pair of a run."""

    records: list[generator.Record] = field(default_factory=list)
    wall_s: float = 0.0
    rounds: list[tuple[float, float]] = field(default_factory=list)  # (tokens, wall seconds) of each round
    ttfts: list[list[float]] = field(default_factory=list)  # the streamed requests' TTFTs of each round
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by process role
    counters: dict[str, float] = field(default_factory=dict)  # counter deltas (COUNTERS, PHASE_SAMPLES)

    def add(self, res: generator.RunResult, tokens_per_s: float) -> None:
        self.records += res.records
        self.wall_s += res.wall_s
        self.rounds.append((tokens_per_s * res.wall_s, res.wall_s))
        self.ttfts.append(_ttfts(res.records))


def _run_pair(
    opts: CompareOptions, inst: int, tallies: dict[str, _Tally], round_ratios: dict[str, list[float]]
) -> dict[str, dict[str, float]]:
    """The rounds on server set number ``inst`` (started fresh, :func:`_running`), added to ``tallies`` and
    ``round_ratios``. Each round runs every system once, the order rotated by one each round (A B, B A;
    A B C, B C A, C A B): a system's place in the round, which moves its figures by a few percent here,
    is the same for all over whole cycles. Returns, for each system compared with the reference (the scenario's second:
    its first and, when the scenario has one, its A/A twin), the set's own figures against the
    reference: throughput ratio, TTFT p50 difference (ms) and API CPU ratio (CPU seconds per request of
    the server process)."""
    names = list(tallies)
    ref, compared = names[1], [n for n in names if n != names[1]]
    first_round, first_record = len(tallies[ref].rounds), {n: len(t.records) for n, t in tallies.items()}
    cpu: dict[str, dict[str, float]] = {n: {} for n in names}
    with _running(opts, fresh=inst == 0, reverse=inst % 2 == 1) as servers:
        before: dict[str, dict[str, float]] = {}
        for rnd in range(-opts.warmup, opts.rounds):
            if rnd == 0:
                for name, srv in servers.items():
                    srv.resume()
                    before[name] = _counters(srv.url)
                    srv.pause()
            first_pair = (inst * (opts.warmup + opts.rounds) + rnd + opts.warmup) * opts.pairs
            rate: dict[str, float] = {}
            for name in report.rotation(names, rnd):
                res = _measure(servers[name], opts, first_pair, cpu[name] if rnd >= 0 else None)
                rate[name] = report.summarize(res.records, res.wall_s)["tokens_per_s"]
                if rnd >= 0:
                    tallies[name].add(res, rate[name])
            if rnd >= 0:
                for name in compared:
                    round_ratios[name].append(rate[name] / rate[ref] if rate[ref] else math.nan)
        for name, srv in servers.items():
            srv.resume()
            total = tallies[name].counters
            for k, v in _counters(srv.url).items():
                total[k] = total.get(k, 0.0) + v - before.get(name, {}).get(k, 0.0)
    tokens_per_s, p50, api = {}, {}, {}
    for name, tally in tallies.items():
        for role, used in cpu[name].items():
            tally.cpu_s[role] = tally.cpu_s.get(role, 0.0) + used
        rounds, ttfts = tally.rounds[first_round:], [t for r in tally.ttfts[first_round:] for t in r]
        tokens_per_s[name] = sum(t for t, _ in rounds) / sum(w for _, w in rounds)
        p50[name] = statistics.median(ttfts) if ttfts else math.nan
        api[name] = cpu[name].get("api", math.nan) / max(1, len(tally.records) - first_record[name])
    return {
        name: {
            "throughput_ratio": tokens_per_s[name] / tokens_per_s[ref],
            "ttft_p50_diff_ms": 1000 * (p50[name] - p50[ref]),
            "api_cpu_ratio": api[name] / api[ref] if api[ref] else math.nan,
        }
        for name in compared
    }


def _intervals(
    name: str, ref: str, tallies: dict[str, _Tally], per_instance: list[dict[str, dict[str, float]]]
) -> dict[str, tuple[float, float]]:
    """90 % intervals of ``name`` against ``ref``: with one server set, rounds resampled (the spread
    between server instances left out); with more, t intervals over the sets' own figures."""
    if len(per_instance) > 1:
        return _pair_intervals([inst[name] for inst in per_instance])
    return {
        "throughput_ratio_ci90": report.ratio_interval(tallies[name].rounds, tallies[ref].rounds),
        "ttft_p50_diff_ci90_ms": report.p50_diff_interval_ms(tallies[name].ttfts, tallies[ref].ttfts),
    }


def floor_verdict(value: float, floor: tuple[float, float], unit: str = "") -> str:
    """Whether ``value`` lies inside the A/A interval ``floor`` (low, high): "within the floor", or
    "outside it, by X" (the distance to the nearer bound, in the figure's ``unit``; ratios as %)."""
    low, high = floor
    if any(math.isnan(x) for x in (value, low, high)):
        return "not resolved (no A/A figure)"
    if low <= value <= high:
        return "within the floor"
    by = value - high if value > high else value - low
    return f"outside it, by {by:+.1f}{unit}" if unit else f"outside it, by {100 * by:+.1f} %"


def throughput(opts: CompareOptions) -> dict[str, Any]:
    """Rounds on every system of a throughput scenario, on ``opts.instances`` server sets one after the
    other (:func:`_run_pair`); returns the result (records as :class:`~server.workload.generator.Record`).
    Where the scenario has an A/A twin of its reference (``overhead``: a second stock server), ``floor``
    holds the twin's figures against the reference from the same rounds and ``verdict`` says whether the
    first system's lie inside them."""
    sides = systems(opts)
    names = [s.name for s in sides]
    a, b = names[:2]
    tallies = {n: _Tally() for n in names}
    round_ratios: dict[str, list[float]] = {n: [] for n in names if n != b}
    per_instance = [_run_pair(opts, inst, tallies, round_ratios) for inst in range(opts.instances)]
    records = {name: t.records for name, t in tallies.items()}
    deltas = {name: t.counters for name, t in tallies.items()}
    summaries = {name: report.summarize(t.records, t.wall_s) for name, t in tallies.items()}
    result: dict[str, Any] = {
        "summaries": summaries,
        "ratios": report.ratios(summaries[a], summaries[b]),
        "round_throughput_ratios": round_ratios[a],
        "median_round_throughput_ratio": statistics.median(round_ratios[a]) if round_ratios[a] else math.nan,
        # How far the headline figures can be trusted on this machine (90 % intervals, above).
        **_intervals(a, b, tallies, per_instance),
        # Each server set's own figures: how far two sets of the same systems differ on this machine.
        "instances": [inst[a] for inst in per_instance],
        "counters": {n: {k: v for k, v in d.items() if not k.startswith(PHASE_SAMPLES)} for n, d in deltas.items()},
        # CPU milliseconds per request by process role: where a wrapper's cost shows even when the
        # machine's noise hides it in throughput (the API process runs image preprocessing and vlguard).
        "cpu_ms_per_request": {
            name: {role: 1000 * used / max(1, len(t.records)) for role, used in sorted(t.cpu_s.items())}
            for name, t in tallies.items()
        },
        # Where the time to first token goes, mean ms per request (vLLM's own histograms, report.phases_ms).
        "ttft_phases_ms": {name: report.phases_ms(records[name], deltas[name]) for name in (a, b)},
        # The streamed requests' TTFT phase by phase, stamped in both servers (report.trace_phases_ms).
        "ttft_trace_ms": {
            name: report.trace_phases_ms(records[name], phase_trace.read(trace_path(system, opts)))
            for name, system in zip((a, b), sides, strict=False)
            if opts.trace
        },
        # Requests each engine served in those rounds: the client's plus the server's own (probes).
        "engine_requests": {n: deltas[n].get(report.TTFT_PHASES["vllm_ttft"] + "_count") for n in names},
        "records": records,
    }
    if len(names) > 2:  # the A/A floor, measured in the same rounds
        twin = names[2]
        floor = {
            "name": twin,
            "ratios": report.ratios(summaries[twin], summaries[b]),
            "median_round_throughput_ratio": statistics.median(round_ratios[twin]),
            **_intervals(twin, b, tallies, per_instance),
            "instances": [inst[twin] for inst in per_instance],
        }
        result["floor"] = floor
        result["verdict"] = _verdicts(result, floor)
    return result


def _verdicts(result: dict[str, Any], floor: dict[str, Any]) -> dict[str, str]:
    """The first system's throughput ratio, TTFT p50 difference and (with several server sets) API CPU
    ratio against the A/A floor's intervals (:func:`floor_verdict`)."""
    out = {
        "throughput": floor_verdict(result["ratios"]["throughput"], floor["throughput_ratio_ci90"]),
        "ttft_p50": floor_verdict(result["ratios"]["ttft_p50_diff_ms"], floor["ttft_p50_diff_ci90_ms"], " ms"),
    }
    if "api_cpu_ratio_ci90" in floor:
        mean_api = statistics.fmean(i["api_cpu_ratio"] for i in result["instances"])
        out["api_cpu"] = floor_verdict(mean_api, floor["api_cpu_ratio_ci90"])
    return out


async def restart_on_exit(srv: ServerProcess, system: System) -> None:
    """Start the stock server again at once whenever it exited (it does on engine death), as systemd's
    ``Restart=always`` would; runs until cancelled. Does nothing for vlguard (it recovers in-process)."""
    while True:
        if system.stock and srv.proc is not None and srv.proc.poll() is not None:
            srv.start()
        await asyncio.sleep(0.2)


def keeps_spare(srv: ServerProcess) -> bool:
    """Whether the vlguard server ``srv`` was started with spare engine processes (``--guard-spare``, else
    ``VLGUARD_SPARE`` in its environment; default on)."""
    if "--guard-spare" in srv.argv[:-1]:
        return srv.argv[srv.argv.index("--guard-spare") + 1] != "off"
    return srv.env.get("VLGUARD_SPARE", "on") != "off"


def wait_serving(srv: ServerProcess, timeout_s: float) -> None:
    """``srv`` ready and, where it is vlguard keeping a spare engine process, that spare up too (as it is
    hours after start-up): every measured run then starts from the same state."""
    srv.wait_ready(timeout_s)
    if srv.ready_path == "/ready" and keeps_spare(srv):  # vlguard
        spare_ready(srv, timeout_s)


def spare_ready(srv: ServerProcess, timeout_s: float) -> bool | None:
    """Wait (at most ``timeout_s`` seconds) for vlguard's spare engine process to be ready, as it is when
    an engine dies hours after start-up. Returns whether it is; None where the server keeps none
    (``--guard-spare off``, or vLLM forks): no spare spawned within 10 s of the call (vlguard spawns it
    right after the engine is READY)."""
    now = time.monotonic()
    deadline, none_after = now + timeout_s, now + min(timeout_s, 10.0)
    while True:
        samples = metric_samples(srv.url, "vlguard_engine_spare")
        if samples.get("vlguard_engine_spare_up", 0) == 1:
            return True
        if not samples.get("vlguard_engine_spare_events_total") and time.monotonic() >= none_after:
            return None
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


async def _kill_run(srv: ServerProcess, system: System, opts: CompareOptions) -> dict[str, Any]:
    plan = generator.TwoPassPlan(opts.workload)
    state: dict[str, Any] = {"succeeded": 0, "killed_at": None}

    def on_record(rec: generator.Record) -> None:
        state["succeeded"] += rec.ok
        if state["killed_at"] is None and state["succeeded"] >= opts.kill_after:
            srv.engine_core().kill()  # SIGKILL
            state["killed_at"] = time.monotonic()

    async with httpx.AsyncClient(timeout=30) as client:  # asked now: a restarting stock server cannot answer
        model = (await client.get(srv.url + "/v1/models")).json()["data"][0]["id"]
    spare = None if system.stock else spare_ready(srv, 0)  # waited for at start-up (_running)
    supervisor = asyncio.create_task(restart_on_exit(srv, system))
    try:
        res = await generator.run(
            srv.url,
            plan,
            pairs=opts.pairs,
            concurrency=opts.concurrency,
            model=model,
            progress=opts.progress,
            on_record=on_record,
        )
        kill_s = None if state["killed_at"] is None else state["killed_at"] - res.started_at  # run's clock
        recovered = [
            r.start_s + r.e2e_s - kill_s for r in res.records if r.ok and kill_s is not None and r.start_s > kill_s
        ]
        # The load ended before the system recovered (a restarting stock server refuses connections):
        # keep sending pairs, outside the counted load, until one request succeeds.
        probe, probes = opts.pairs, []
        deadline = time.monotonic() + opts.ready_timeout_s
        while kill_s is not None and not recovered and time.monotonic() < deadline:
            extra = await generator.run(
                srv.url, plan, pairs=1, first_pair=probe, concurrency=1, model=model, progress=False
            )
            for r in extra.records:
                r.start_s += extra.started_at - res.started_at  # onto the load's clock
            probes += extra.records
            recovered = [r.start_s + r.e2e_s - kill_s for r in extra.records if r.ok]
            probe += 1
            if not recovered:
                await asyncio.sleep(0.5)  # probe pacing while the server is down
    finally:
        supervisor.cancel()
    summary = report.summarize(res.records, res.wall_s)
    return {
        "summary": summary,
        "kill_s": kill_s,
        "first_success_after_kill_s": min(recovered) if recovered else None,
        "spare_ready_at_kill": spare,  # vlguard: its spare was ready before the load (None: keeps none)
        "records": res.records,
        "probes": probes,  # not in the summary: sent after the counted load, to find the recovery time
    }


def kill(opts: CompareOptions) -> dict[str, Any]:
    """The kill-and-recover scenario, one system after the other; returns the result (per system: summary,
    kill time, first success after it, records and probes as :class:`~server.workload.generator.Record`)."""
    results: dict[str, dict[str, Any]] = {}
    with _running(opts) as servers:
        for system in SCENARIOS["kill"]:
            srv = servers[system.name]
            srv.resume()
            results[system.name] = asyncio.run(_kill_run(srv, system, opts))
            srv.pause()
    a, b = (results[s.name]["first_success_after_kill_s"] for s in SCENARIOS["kill"])
    return {"systems": results, "recovery_ratio": a / b if a and b else math.nan}
