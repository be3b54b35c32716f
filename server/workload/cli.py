"""``vlguard bench twopass`` and ``vlguard bench compare`` (argument parsing and output files).

``twopass`` drives one running server and prints a table; ``compare`` starts two systems itself (see
:mod:`server.workload.compare`). Both write JSON and PNG charts into ``--out`` (default ``bench-out/``).
Loopback only by intent: ``compare`` starts its servers on 127.0.0.1; ``twopass`` sends to ``--url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from server.workload import compare, generator, plots, report

T = TypeVar("T")


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(x) for x in text.split(","))
    if not sizes or min(sizes) < 28:
        raise argparse.ArgumentTypeError("comma-separated pixel sizes, each at least 28")
    return sizes


def _counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(x) for x in text.split(","))
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("comma-separated counts, each at least 1")
    return counts


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("a fraction between 0 and 1")
    return value


def _workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--concurrency", type=int, default=4, help="pairs in flight at once (default 4)")
    g.add_argument(
        "--image-sizes",
        type=_sizes,
        default=(224, 336, 448),
        help="longest image sides in px, one chosen per pair (default 224,336,448)",
    )
    g.add_argument("--image-dir", type=Path, help="read images from this folder (default: scikit-image's photos)")
    g.add_argument("--primary-words", type=int, default=40, help="extra words in the primary prompt (default 40)")
    g.add_argument("--rescue-words", type=int, default=120, help="extra words in the rescue turn (default 120)")
    g.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (EOS ignored; default 16)")
    g.add_argument("--stream-share", type=_share, default=0.5, help="fraction of requests streamed (default 0.5)")
    g.add_argument("--seed", type=int, default=0, help="workload seed: same seed, same requests (default 0)")
    g.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for JSON and PNG (default bench-out)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _from_flags(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The dataclass ``cls`` from the parsed flags named as its fields, ``given`` over them (fields without a
    flag of their name keep their defaults)."""
    flags = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    return cls(**{**flags, **given})


def _config(args: argparse.Namespace) -> generator.TwoPassConfig:
    return _from_flags(generator.TwoPassConfig, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlguard bench", description="Two-pass workload and comparisons.")
    sub = parser.add_subparsers(dest="bench", required=True)
    tp = sub.add_parser("twopass", help="Send the two-pass workload to a running server; print and save results.")
    tp.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    tp.add_argument("--model", help="served model name (default: the server's first model)")
    tp.add_argument("--api-key", default="unused", help="bearer token, if the server wants one")
    bound = tp.add_mutually_exclusive_group()
    bound.add_argument("--pairs", type=int, default=16, help="images to send, two requests each (default 16)")
    bound.add_argument("--duration", type=float, help="seconds to keep starting pairs (instead of --pairs)")
    _workload_args(tp)

    cmp_ = sub.add_parser(
        "compare",
        help="Run the workload against two systems started here, side by side; print the ratios.",
        usage="vlguard bench compare MODEL [options] [-- vllm serve flags for both systems]",
    )
    cmp_.add_argument("model", help="model path or name, as for `vllm serve`")
    cmp_.add_argument(
        "--scenario",
        choices=[*sorted(compare.SCENARIOS), "fault", "poison", "front", "engine", "overload"],
        default="overhead",
        help="overhead: vlguard vs stock; noise: stock vs stock (the machine's floor); "
        "kill: engine killed mid-run, vlguard vs stock; "
        "alignment / patches: vlguard with that feature on vs off; fault: a step fault every --fault-every "
        "seconds, vlguard soft recovery vs rebuild vs stock restarted (test fault plugin); poison: one client "
        "sends a varied poison every --fault-every seconds beside the load, vlguard with and without the "
        "per-client fault budget (test fault plugin); front: the API process alone, stock's app vs vlguard's "
        "and stock vs stock, over a null engine core: CPU per request; engine: the engine core in-process, "
        "vLLM's own vs with vlguard's engine-side hooks and stock vs stock, on one recorded step sequence: "
        "cost per step; overload: open-loop floods at multiples of stock's capacity, stock then vlguard: "
        "goodput, refusals, wasted tokens (default overhead)",
    )
    cmp_.add_argument("--rounds", type=int, default=6, help="measured rounds, the order rotated each round (default 6)")
    cmp_.add_argument(
        "--instances",
        type=int,
        default=1,
        help="throughput scenarios: server pairs, each started fresh and run for --rounds, one after the other; "
        "with 2 or more the intervals are t intervals over the pairs' own figures, which carry the spread "
        "between server instances (default 1)",
    )
    cmp_.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted (default 1)")
    cmp_.add_argument("--pairs", type=int, default=8, help="pairs per round and system; kill: in all (default 8)")
    cmp_.add_argument("--kill-after", type=int, default=10, help="kill: successes before the kill (default 10)")
    cmp_.add_argument(
        "--fault-every", type=float, default=10.0, help="fault, poison: seconds between faults (default 10)"
    )
    cmp_.add_argument(
        "--fault-duration",
        type=float,
        default=40.0,
        help="fault, poison: seconds of load per run (fault: with and without faults)",
    )
    cmp_.add_argument(
        "--in-flight",
        type=_counts,
        help="kill, fault: the guard at scale instead: vlguard alone, for each of these load sizes (e.g. "
        "8,64,256) a run of 2N pairs with N requests in flight, uninterrupted and with the fault; time from the "
        "fault until every request completed, failed requests, API RSS peak (raise --max-num-seqs to match)",
    )
    cmp_.add_argument(
        "--emulate-padding",
        action="store_true",
        help="vlguard sides emulate CUDA-graph padding on CPU through the test plugin (development environments only)",
    )
    cmp_.add_argument(
        "--no-trace",
        action="store_true",
        help="throughput scenarios: without the phase-by-phase TTFT trace in both servers (it costs vlguard's "
        "side, which has more points, slightly more than stock's)",
    )
    cmp_.add_argument(
        "--no-floor",
        action="store_true",
        help="overhead: without the A/A stock twin (two servers instead of three: quicker, but the figures are "
        "not set against the machine's floor)",
    )
    ov = cmp_.add_argument_group("overload")
    ov.add_argument(
        "--multipliers",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=(1.0, 2.0, 3.0, 5.0),
        help="offered loads in multiples of stock's measured capacity (default 1,2,3,5)",
    )
    ov.add_argument("--point-duration", type=float, default=40.0, help="seconds of each flood (default 40)")
    ov.add_argument("--caller-timeout", type=float, default=15.0, help="seconds a caller waits (default 15)")
    _workload_args(cmp_)
    sub.add_parser("normalize", help="Time image normalisation, off vs on, per image (no server).")
    return parser


def _jsonable(obj: Any) -> Any:
    """``json.dumps`` fallback: dataclasses (records, configs) as dicts, anything else (paths) as text."""
    return asdict(obj) if is_dataclass(obj) and not isinstance(obj, type) else str(obj)


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=1, default=_jsonable, allow_nan=True))
    return path


def twopass(args: argparse.Namespace) -> int:
    plan = generator.TwoPassPlan(_config(args))
    pairs = None if args.duration is not None else args.pairs
    res = asyncio.run(
        generator.run(
            args.url,
            plan,
            pairs=pairs,
            duration_s=args.duration,
            concurrency=args.concurrency,
            model=args.model,
            api_key=args.api_key,
            progress=not args.no_progress,
        )
    )
    summary = report.summarize(res.records, res.wall_s)
    print(report.table({"server": summary}))
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"url": args.url, "workload": plan.config, "summary": summary, "records": res.records}
    written = [
        _write_json(args.out / "twopass.json", data),
        plots.latency_plot({"server": res.records}, args.out / "twopass-latency.png", "two-pass workload"),
    ]
    print("wrote", *written)
    return 0 if summary["failed"] == 0 else 1


def trace_table(a: str, b: str, pa: dict[str, dict[str, float]], pb: dict[str, dict[str, float]]) -> str:
    """The TTFT phase by phase of both systems (``report.trace_phases_ms``): p50 and mean, ms, and A - B."""
    nan = {"p50": math.nan, "mean": math.nan, "n": 0}
    rows = [
        f"{'TTFT phase (streamed requests)':30} {a + ' p50':>13} {b + ' p50':>13} {'diff':>7} "
        f"{a + ' mean':>13} {b + ' mean':>13} {'diff':>7}"
    ]
    for name in [*pa, *(n for n in pb if n not in pa)]:
        x, y = pa.get(name, nan), pb.get(name, nan)
        rows.append(
            f"{name:30} {x['p50']:13.2f} {y['p50']:13.2f} {x['p50'] - y['p50']:+7.2f} "
            f"{x['mean']:13.2f} {y['mean']:13.2f} {x['mean'] - y['mean']:+7.2f}"
        )
    for name, phases in ((a, pa), (b, pb)):
        if own := [n for n in report.GUARD_OWN_PHASES if n in phases]:
            p50s = ", ".join(f"{n} {phases[n]['p50']:.2f}" for n in own)
            total, moved = report.added_p50(phases)
            rows.append(f"{name}'s own code on the way to the first token: {total:.2f} ms (sum of p50s: {p50s})")
            if moved:
                rows.append(f"  of it vLLM's work done once in {name}'s code instead (the body's parse): "
                            f"{moved:.2f} ms; added by {name}: {total - moved:.2f} ms")  # fmt: skip
    return "\n".join(rows)


def _print_ratios(a: str, b: str, result: dict[str, Any]) -> None:
    r = result["ratios"]
    print(
        f"ratios {a}/{b}: throughput {r['throughput']:.3f} (median of per-round ratios "
        f"{result['median_round_throughput_ratio']:.3f}), TTFT p50 {r['ttft_p50']:.3f} p99 {r['ttft_p99']:.3f}, "
        f"e2e p50 {r['e2e_p50']:.3f} p99 {r['e2e_p99']:.3f}; TTFT p50 difference {r['ttft_p50_diff_ms']:+.1f} ms"
    )
    instances = result.get("instances", [])
    for i, inst in enumerate(instances if len(instances) > 1 else []):
        print(
            f"server pair {i + 1}: throughput {inst['throughput_ratio']:.3f}, TTFT p50 difference "
            f"{inst['ttft_p50_diff_ms']:+.1f} ms, API CPU {inst['api_cpu_ratio']:.3f}"
        )
    if "throughput_ratio_ci90" in result:
        (t_lo, t_hi), (d_lo, d_hi) = result["throughput_ratio_ci90"], result["ttft_p50_diff_ci90_ms"]
        over = (
            f"t intervals over the {len(instances)} server pairs"
            if len(instances) > 1
            else "bootstrap intervals, rounds resampled in pairs"
        )
        cpu = result.get("api_cpu_ratio_ci90")
        print(
            f"90 % {over}: throughput ratio {t_lo:.3f} to {t_hi:.3f}, "
            f"TTFT p50 difference {d_lo:+.1f} to {d_hi:+.1f} ms"
            + (f", API CPU ratio {cpu[0]:.3f} to {cpu[1]:.3f}" if cpu else "")
        )
        if len(instances) <= 1:
            print(
                "  (one server pair: the intervals leave out the spread between server instances, a few "
                "percent on a 2-core machine; --instances N measures it)"
            )
    if floor := result.get("floor"):
        fr, verdict = floor["ratios"], result["verdict"]
        (t_lo, t_hi), (d_lo, d_hi) = floor["throughput_ratio_ci90"], floor["ttft_p50_diff_ci90_ms"]
        print(
            f"A/A floor, same rounds ({floor['name']}/{b}): throughput {fr['throughput']:.3f} (90 % {t_lo:.3f} to "
            f"{t_hi:.3f}), TTFT p50 difference {fr['ttft_p50_diff_ms']:+.1f} ms (90 % {d_lo:+.1f} to {d_hi:+.1f})"
        )
        print(f"{a} against the floor: " + "; ".join(f"{k} {v}" for k, v in verdict.items()))
    for name, roles in result.get("cpu_ms_per_request", {}).items():
        print(f"{name} CPU per request: " + ", ".join(f"{role} {ms:.1f} ms" for role, ms in roles.items()))
    for name, phases in result.get("ttft_phases_ms", {}).items():
        print(f"{name} TTFT phases, mean ms: " + ", ".join(f"{phase} {ms:.1f}" for phase, ms in phases.items()))
    if traced := result.get("ttft_trace_ms"):
        print(trace_table(a, b, traced[a], traced[b]))
    served = {name: n for name, n in result.get("engine_requests", {}).items() if n is not None}
    if served:
        print(
            "requests the engines served (the client's and their own): "
            + ", ".join(f"{k} {n:g}" for k, n in served.items())
        )
    for name, counters in result["counters"].items():
        if counters:
            print(f"{name} counters over the measured rounds: " + ", ".join(f"{k}={v:g}" for k, v in counters.items()))


def compare_main(args: argparse.Namespace, serve_args: list[str]) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    opts = _from_flags(
        compare.CompareOptions,
        args,
        serve_args=tuple(serve_args),
        workload=_config(args),
        fault_every_s=args.fault_every,
        fault_duration_s=args.fault_duration,
        progress=not args.no_progress,
        trace=not args.no_trace,
        floor=not args.no_floor,
    )
    stem = args.out / f"compare-{args.scenario}"
    if args.instances < 1 or (args.instances > 1 and args.scenario in ("kill", "fault", "poison")):
        print("vlguard bench compare: --instances takes 1 or more, and only 1 with kill or fault", file=sys.stderr)
        return 2
    if args.in_flight and args.scenario in ("kill", "fault"):
        return _scale_main(opts, args.scenario, args.in_flight, stem)
    if args.in_flight:
        print("vlguard bench compare: --in-flight goes with --scenario kill or fault", file=sys.stderr)
        return 2
    if args.scenario == "fault":
        return _fault_main(opts, stem)
    if args.scenario == "poison":
        return _poison_main(opts, stem)
    if args.scenario == "overload":
        return _overload_main(opts, args, stem)
    if args.scenario == "front":
        return _front_main(opts, stem)
    if args.scenario == "engine":
        return _engine_main(opts, stem)
    a, b = (s.name for s in compare.SCENARIOS[args.scenario][:2])
    if args.scenario == "kill":
        result = compare.kill(opts)
        for name, s in result["systems"].items():
            rec = s["first_success_after_kill_s"]
            print(
                f"{name:8} first success after kill: {rec if rec is None else f'{rec:.1f} s'}; "
                f"failed {s['summary']['failed']} of {s['summary']['requests']} "
                f"(non-streaming {s['summary']['failed_non_streaming']}, streaming {s['summary']['failed_streaming']})"
                + ("; its spare engine process was NOT ready" if s.get("spare_ready_at_kill") is False else "")
            )
        print(f"recovery time ratio vlguard/stock: {result['recovery_ratio']:.2f}")
        written = [
            plots.timeline_plot(
                {k: (v["records"] + v["probes"], v["kill_s"] or 0.0) for k, v in result["systems"].items()},
                stem.with_name(stem.name + "-timeline.png"),
            ),
            plots.latency_plot(
                {k: v["records"] for k, v in result["systems"].items()},
                stem.with_name(stem.name + "-latency.png"),
                "latency with an engine kill",
            ),
        ]
        print(report.table({k: v["summary"] for k, v in result["systems"].items()}))
    else:
        result = compare.throughput(opts)
        print(report.table(result["summaries"]))
        _print_ratios(a, b, result)
        written = [
            plots.latency_plot(
                result["records"], stem.with_name(stem.name + "-latency.png"), f"{args.scenario}: {a} vs {b}"
            )
        ]
    result |= {
        "scenario": args.scenario,
        "model": args.model,
        "serve_args": serve_args,
        "workload": opts.workload,
    }
    written.insert(0, _write_json(stem.with_suffix(".json"), result))
    print("wrote", *written)
    return 0


def _front_main(opts: compare.CompareOptions, stem: Path) -> int:
    from server.workload import front

    result = front.run(opts.model, list(opts.serve_args), opts.out, opts.workload, rounds=opts.rounds,
                       warmup=opts.warmup, pairs=opts.pairs, concurrency=opts.concurrency,
                       progress=opts.progress)  # fmt: skip
    for line in front.summary_lines(result):
        print(line)
    payload = {
        "scenario": "front", "model": opts.model, "serve_args": opts.serve_args, "workload": opts.workload,
        "cpu_ms": result.cpu_ms, "failed": result.failed, "own_ms": result.own_ms, "own_cpu_ms": result.own_cpu_ms,
        "ratio": result.ratio("vlguard", "stock-a"), "aa_ratio": result.ratio("stock-b", "stock-a"),
        "added_ms": result.added_ms("vlguard", "stock-a"), "aa_added_ms": result.added_ms("stock-b", "stock-a"),
        "api_servers": result.api_servers, "rps": result.rps,
        "rps_ratio": result.ratio("vlguard", "stock-a", of="rps"),
        "aa_rps_ratio": result.ratio("stock-b", "stock-a", of="rps"),
        "loop_cpu_ms": result.loop_cpu_ms,
        "loop_ratio": result.ratio("vlguard", "stock-a", of="loop_cpu_ms"),
        "aa_loop_ratio": result.ratio("stock-b", "stock-a", of="loop_cpu_ms"),
        "loop_added_ms": result.added_ms("vlguard", "stock-a", of="loop_cpu_ms"),
    }  # fmt: skip
    print("wrote", _write_json(stem.with_suffix(".json"), payload))
    return 0


def _engine_main(opts: compare.CompareOptions, stem: Path) -> int:
    from server.workload import engine_step

    result = engine_step.run(opts.model, list(opts.serve_args), opts.out, opts.workload, rounds=opts.rounds,
                             warmup=opts.warmup, pairs=opts.pairs, ready_timeout_s=opts.ready_timeout_s)  # fmt: skip
    for line in engine_step.summary_lines(result):
        print(line)
    payload = {
        "scenario": "engine", "model": opts.model, "serve_args": opts.serve_args, "workload": opts.workload,
        "rounds": result.rounds,
        "ratios": {f"{name}/stock-a": {what: result.ratio(name, "stock-a", i)
                                       for i, what in engine_step.MEASURES.items()}
                   for name in ("vlguard", "stock-b")},
    }  # fmt: skip
    print("wrote", _write_json(stem.with_suffix(".json"), payload))
    return 0


def _scale_main(opts: compare.CompareOptions, kind: str, sizes: tuple[int, ...], stem: Path) -> int:
    from server.workload import scale

    result = scale.scale(opts, kind, sizes)
    for line in scale.summary_lines(result):
        print(line)
    result |= {"scenario": kind, "model": opts.model, "serve_args": opts.serve_args, "workload": opts.workload}
    print("wrote", _write_json(stem.with_name(stem.name + "-scale.json"), result))
    return 0


def _overload_main(opts: compare.CompareOptions, args: argparse.Namespace, stem: Path) -> int:
    from server.workload import overload

    load = overload.Load(args.multipliers, args.point_duration, args.caller_timeout)
    result = overload.overload(replace(opts, trace=False), load)  # no phase trace: latency is not measured
    for line in overload.summary_lines(result):
        print(line)
    result |= {"scenario": "overload", "model": opts.model, "serve_args": opts.serve_args, "workload": opts.workload}
    written = [
        _write_json(stem.with_suffix(".json"), result),
        plots.goodput_plot({k: v["points"] for k, v in result["systems"].items()}, stem.with_name(stem.name + ".png")),
    ]
    print("wrote", *written)
    return 0


def _poison_main(opts: compare.CompareOptions, stem: Path) -> int:
    from server.workload import poison

    result = poison.poison(opts)
    for name, s in result["systems"].items():
        print(
            f"{name:9} innocents failed {s['innocent_failed']} of {s['summary']['requests']}; "
            f"soft recoveries {s['soft_recoveries']:.0f}, rebuilds {s['rebuilds']:.0f}; poison sent "
            f"{s['poison_sent']}, answered {s['poison_answers']}, faults charged to its client "
            f"{s['poison_client_faults']:.0f} (engine faults {s['engine_faults']:.0f}); restart budget left "
            f"{s['restart_budget_left']:.0f}; API RSS peak {s['api_rss_peak_mb']:.0f} MiB"
        )
    print(report.table({k: v["summary"] for k, v in result["systems"].items()}))
    result |= {"scenario": "poison", "model": opts.model, "serve_args": opts.serve_args, "workload": opts.workload}
    print("wrote", _write_json(stem.with_suffix(".json"), result))
    return 0


def _fault_main(opts: compare.CompareOptions, stem: Path) -> int:
    from server.workload import faults

    result = faults.fault(opts)
    for name, s in result["systems"].items():
        first = s["first_success_after_fault_s"]
        shown = "n/a" if first["median"] is None else f"median {first['median']:.2f} s, max {first['max']:.2f} s"
        print(
            f"{name:8} faults {len(s['faults_s'])}; first success after a fault: {shown}; failed "
            f"{s['faulted']['failed']} of {s['faulted']['requests']}; throughput with faults / without "
            f"{s['throughput_ratio']:.3f}"
        )
    print(report.table({f"{k} (faults)": v["faulted"] for k, v in result["systems"].items()}
                       | {f"{k} (none)": v["baseline"] for k, v in result["systems"].items()}))  # fmt: skip
    result |= {"scenario": "fault", "model": opts.model, "serve_args": opts.serve_args, "workload": opts.workload}
    print("wrote", _write_json(stem.with_suffix(".json"), result))
    return 0


def main(argv: list[str]) -> int:
    """``vlguard bench ...`` (``argv`` without ``bench``). Everything after ``--`` goes to both servers."""
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1 :]
    if argv[:1] == ["normalize"]:  # no server involved: the media policy's image work alone
        from server.workload import normalize_bench

        return normalize_bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.bench == "twopass":
        if serve_args:
            print("vlguard bench twopass: no server flags after -- (it drives a running server)", file=sys.stderr)
            return 2
        return twopass(args)
    return compare_main(args, serve_args)
