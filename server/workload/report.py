"""Summaries, ratios and tables of benchmark runs (pure functions over :class:`~server.workload.generator.Record`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from server.workload.generator import Record

PERCENTILES = (50, 90, 99)


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """``{"p50": ms, "p90": ms, "p99": ms}`` (linear interpolation); NaN for an empty sample."""
    if not seconds:
        return {f"p{p}": math.nan for p in PERCENTILES}
    values = np.percentile(np.asarray(seconds) * 1000.0, PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, values, strict=True)}


def rotation(names: Sequence[str], rnd: int) -> list[str]:
    """The order of round ``rnd``: ``names`` rotated by ``rnd`` (A B C, B C A, C A B, ...), so over whole
    cycles every system runs in every place of a round equally often (a place moved a server's figures
    by 2-4 % on a 2-core machine)."""
    shift = rnd % len(names)
    return [*names[shift:], *names[:shift]]


def summarize(records: Iterable[Record], wall_s: float) -> dict[str, Any]:
    """Counts, errors by kind, throughput and latency percentiles of one run (or of several runs'
    records with their summed wall time).

    Throughput: successful requests per second and tokens (prompt + completion, from usage) per second
    over ``wall_s``. TTFT is measured on streamed requests only; e2e on every successful request.
    """
    recs = list(records)
    ok = [r for r in recs if r.ok]
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in ok)
    return {
        "requests": len(recs),
        "succeeded": len(ok),
        "failed": len(recs) - len(ok),
        "failed_streaming": sum(1 for r in recs if not r.ok and r.stream),
        "failed_non_streaming": sum(1 for r in recs if not r.ok and not r.stream),
        "errors": dict(sorted(Counter(r.error for r in recs if r.error).items())),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else math.nan,
        "tokens_per_s": tokens / wall_s if wall_s else math.nan,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else math.nan,
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e_ms": percentiles_ms([r.e2e_s for r in ok]),
    }


def p50_diff_interval_ms(
    a_rounds: Sequence[Sequence[float]],
    b_rounds: Sequence[Sequence[float]],
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Bootstrap interval of ``p50(a) - p50(b)`` in ms: how far a run's TTFT p50 difference can be trusted.

    Rounds are resampled in pairs (a round's two runs together, as in :func:`ratio_interval`), so the
    interval carries the round-to-round drift of the machine, not only the spread within a round; each
    resample's p50s are taken over the chosen rounds' samples.

    Arguments:
        a_rounds, b_rounds: each round's samples of the two systems, seconds, in the same round order.
        level: the interval's coverage (0.9: from the 5th to the 95th percentile of the resampled differences).

    Returns:
        ``(low, high)`` ms; NaNs with fewer than 2 rounds or no samples on a side.
    """
    if len(a_rounds) < 2 or len(a_rounds) != len(b_rounds):
        return math.nan, math.nan
    a = [np.asarray(r, dtype=float) * 1000.0 for r in a_rounds]
    b = [np.asarray(r, dtype=float) * 1000.0 for r in b_rounds]
    diffs = []
    for pick in np.random.default_rng(seed).integers(0, len(a), (resamples, len(a))):
        xa, xb = np.concatenate([a[i] for i in pick]), np.concatenate([b[i] for i in pick])
        if xa.size and xb.size:
            diffs.append(float(np.median(xa) - np.median(xb)))
    if not diffs:
        return math.nan, math.nan
    tail = 50.0 * (1.0 - level)
    low, high = np.percentile(diffs, (tail, 100.0 - tail))
    return float(low), float(high)


def ratio_interval(
    a_rounds: Sequence[tuple[float, float]],
    b_rounds: Sequence[tuple[float, float]],
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Bootstrap interval of the throughput ratio ``a / b`` over paired rounds (a round's two runs are
    resampled together, which keeps the pairing that cancels the machine's drift).

    Arguments:
        a_rounds, b_rounds: ``(tokens, wall seconds)`` of each round, in the same order on both sides.

    Returns:
        ``(low, high)``; NaNs when there are fewer than 2 rounds.
    """
    if len(a_rounds) < 2 or len(a_rounds) != len(b_rounds):
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a_rounds, dtype=float), np.asarray(b_rounds, dtype=float)
    idx = rng.integers(0, len(a), (resamples, len(a)))
    rate_a = a[idx, 0].sum(axis=1) / a[idx, 1].sum(axis=1)
    rate_b = b[idx, 0].sum(axis=1) / b[idx, 1].sum(axis=1)
    tail = 50.0 * (1.0 - level)
    low, high = np.percentile(rate_a / rate_b, (tail, 100.0 - tail))
    return float(low), float(high)


def pair_interval(values: Sequence[float], level: float = 0.9, log: bool = False) -> tuple[float, float]:
    """Student-t interval of the mean of per-server-pair figures (``vlguard bench compare --instances N``).

    Two identically built servers differ by several percent for a whole run on a 2-core machine
    (docs/benchmarks.md, the A/A runs), so a run's server pairs, not its rounds, are the independent
    samples; with a handful of pairs a bootstrap over them comes out too narrow (few distinct
    resamples), the t interval does not.

    Arguments:
        values: one figure per server pair (a throughput ratio, a TTFT p50 difference in ms, ...).
        log: the interval of the geometric mean (for ratios).

    Returns:
        ``(low, high)``; NaNs with fewer than 2 finite values.
    """
    from scipy import stats

    x = np.asarray([v for v in values if math.isfinite(v) and (v > 0 or not log)], dtype=float)
    if x.size < 2:
        return math.nan, math.nan
    if log:
        x = np.log(x)
    scale = float(stats.sem(x))
    low, high = stats.t.interval(level, x.size - 1, loc=x.mean(), scale=scale) if scale > 0 else (x.mean(),) * 2
    return (math.exp(low), math.exp(high)) if log else (float(low), float(high))


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """``a / b`` for throughput and latency percentiles, plus the TTFT p50 difference in ms."""

    def div(x: float, y: float) -> float:
        return x / y if y and not math.isnan(y) else math.nan

    out = {"throughput": div(a["tokens_per_s"], b["tokens_per_s"])}
    for metric in ("ttft_ms", "e2e_ms"):
        for p in ("p50", "p99"):
            out[f"{metric.removesuffix('_ms')}_{p}"] = div(a[metric][p], b[metric][p])
    out["ttft_p50_diff_ms"] = a["ttft_ms"]["p50"] - b["ttft_ms"]["p50"]
    return out


#: vLLM's per-request histograms (seconds, recorded in the API process) that split the time to first token
#: from the request's arrival at vLLM's renderer (chat template, tokenization and image preprocessing
#: included) to its first token; and its waiting and prefill parts.
TTFT_PHASES = {
    "vllm_ttft": "vllm:time_to_first_token_seconds",
    "queued": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def phases_ms(records: Iterable[Record], counters: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per request of each part of the time to first token.

    Arguments:
        records: the measured requests (streamed ones give the client's TTFT).
        counters: increases over the same requests of each :data:`TTFT_PHASES` histogram's ``_sum`` and
            ``_count`` samples.

    Returns:
        ``client_ttft`` (mean over streamed requests), one entry per :data:`TTFT_PHASES` key, and
        ``front`` = client TTFT - vLLM's TTFT: the HTTP server, the app's middleware (vlguard's door),
        request parsing, and the first SSE event's way back. NaN where there is no sample. The histograms
        count every request the server ran (streamed or not, and a server's own, such as vlguard's
        readiness probes: compare their count with the records).
    """
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    out = {"client_ttft": 1000.0 * sum(ttfts) / len(ttfts) if ttfts else math.nan}
    for phase, name in TTFT_PHASES.items():
        count = counters.get(name + "_count", 0.0)
        out[phase] = 1000.0 * counters.get(name + "_sum", 0.0) / count if count else math.nan
    out["front"] = out["client_ttft"] - out["vllm_ttft"]
    return out


#: A streamed request's time to first token, phase by phase, as both servers' phase tracers stamp it
#: (:mod:`server.workload.phase_trace`; ``client`` and ``first_token`` are the bench client's): name, from,
#: to. Consecutive: they add up to the client's TTFT.
TRACE_PHASES = (
    ("connect", "client", "asgi"),  # connection, HTTP parsing, waiting for the server's event loop
    ("door", "asgi", "handler"),  # middleware (vlguard's input checks and admission), body, request model
    ("render", "handler", "rendered"),  # chat template, images: Hugging Face preprocessing or a cache hit
    ("submit", "rendered", "submit"),  # sampling parameters, the response's start, an engine client's wrapper
    ("engine", "submit", "output"),  # engine input, the engine core (queue, prefill), output processing
    ("serve", "output", "chunk"),  # detokenized text into the first chunk with content
    ("respond", "chunk", "sent"),  # the chunk's way out through the middleware to the HTTP server
    ("deliver", "sent", "first_token"),  # the socket and the client's parsing
)
#: vlguard's door and engine client within ``door``, ``submit`` and ``serve`` (points only vlguard's tracer
#: stamps)
GUARD_TRACE_PHASES = (
    ("door: to vlguard's input checks", "asgi", "input_guard"),
    ("door: body read", "input_guard", "checks"),
    ("door: vlguard's input checks", "checks", "checked"),
    ("door: to vlguard's admission", "checked", "admission"),
    ("door: request model, route", "admission", "handler"),
    ("submit: to vlguard's client", "rendered", "guard"),
    ("submit: vlguard's client", "guard", "submit"),
    ("serve: vlguard's client", "output", "guard_out"),
    ("door: of it, the body's parse", "parse", "parsed"),
    ("submit: of it, the image cache", "strip", "stripped"),
)


#: the phases that are vlguard's own code on a request's way to its first token (no waiting on the client
#: or the engine in them): its input checks, its engine client on the way in and on the way out
GUARD_OWN_PHASES = ("door: vlguard's input checks", "submit: vlguard's client", "serve: vlguard's client")
#: parts of those shown on their own: the door's parse of the body, the engine client's image cache shadow
GUARD_INNER_PHASES = ("door: of it, the body's parse", "submit: of it, the image cache")
#: the parts that are work vLLM's own path does elsewhere, done once by vlguard's code instead: the body's
#: parse (vLLM's route takes the door's instead of parsing again with ``json.loads``). Not the image cache
#: shadow: stock's renderer does that operation on its cache, but vlguard's renderer does one on its own
#: cache too, so the shadow's is added.
GUARD_MOVED_PHASES = GUARD_INNER_PHASES[:1]
#: every phase of vlguard's own code the front scenario reports: the whole ones and their parts
GUARD_SHOWN_PHASES = (*GUARD_OWN_PHASES, *GUARD_INNER_PHASES)


def added_p50(phases: dict[str, dict[str, float]]) -> tuple[float, float]:
    """``(own, moved)``: the sums of the p50 ms of :data:`GUARD_OWN_PHASES` and of
    :data:`GUARD_MOVED_PHASES` among ``phases``; ``own - moved`` is what vlguard adds to vLLM's path."""
    own = sum(phases[name]["p50"] for name in GUARD_OWN_PHASES if name in phases)
    return own, sum(phases[name]["p50"] for name in GUARD_MOVED_PHASES if name in phases)


def trace_phases_ms(records: Iterable[Record], events: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each :data:`TRACE_PHASES` (and :data:`GUARD_TRACE_PHASES`) phase of the streamed, successful
    requests: ``{phase: {"p50": ms, "mean": ms, "n": requests}}``; a phase no request has both points of is
    left out.

    Arguments:
        records: the measured requests (their ``trace_id``, ``sent_at`` and ``ttft_s``).
        events: one server's trace, ``{trace id: {point: monotonic seconds}}``
            (:func:`server.workload.phase_trace.read`).
    """
    spans: dict[str, list[float]] = {}
    for rec in records:
        points = events.get(rec.trace_id or "")
        if not (rec.ok and rec.stream and rec.ttft_s is not None and points):
            continue
        points = {**points, "client": rec.sent_at, "first_token": rec.sent_at + rec.ttft_s}
        for name, start, end in (*TRACE_PHASES, *GUARD_TRACE_PHASES):
            if start in points and end in points:
                spans.setdefault(name, []).append(1000.0 * (points[end] - points[start]))
    return _summaries(spans, [name for name, _, _ in (*TRACE_PHASES, *GUARD_TRACE_PHASES)])


def own_cpu_ms(records: Iterable[Record], cpu: dict[str, dict[str, tuple[float, int]]]) -> dict[str, dict[str, float]]:
    """The CPU each of :data:`GUARD_SHOWN_PHASES` used per streamed, successful request: its thread's CPU
    time between the phase's points, where one thread stamped both (``cpu``:
    :func:`server.workload.phase_trace.read_cpu`): ``{phase: {"p50": ms, "mean": ms, "n": requests}}``.
    Unlike the phase's time, it leaves out waiting for the GIL."""
    bounds = {name: (start, end) for name, start, end in GUARD_TRACE_PHASES if name in GUARD_SHOWN_PHASES}
    spans: dict[str, list[float]] = {}
    for rec in records:
        points = cpu.get(rec.trace_id or "")
        if not (rec.ok and rec.stream and points):
            continue
        for name, (start, end) in bounds.items():
            if start in points and end in points and points[start][1] == points[end][1]:
                spans.setdefault(name, []).append(1000.0 * (points[end][0] - points[start][0]))
    return _summaries(spans, GUARD_SHOWN_PHASES)


def _summaries(spans: dict[str, list[float]], names: Iterable[str]) -> dict[str, dict[str, float]]:
    """``{name: {"p50", "mean", "n"}}`` of the ``spans`` (ms) of each of ``names`` that has any, in that order."""
    return {
        name: {"p50": float(np.median(spans[name])), "mean": float(np.mean(spans[name])), "n": len(spans[name])}
        for name in names
        if name in spans
    }


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """A fixed-width text table, one row per named summary."""
    head = (
        f"{'system':12} {'requests':>8} {'failed':>6} {'req/s':>7} {'tok/s':>8} "
        f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'e2e p50':>8} {'p90':>7} {'p99':>7}  errors"
    )
    rows = [head, "-" * len(head)]
    for name, s in summaries.items():
        t, e = s["ttft_ms"], s["e2e_ms"]
        rows.append(
            f"{name:12} {s['requests']:8d} {s['failed']:6d} {s['requests_per_s']:7.2f} {s['tokens_per_s']:8.1f} "
            f"{t['p50']:9.1f} {t['p90']:7.1f} {t['p99']:7.1f} {e['p50']:8.1f} {e['p90']:7.1f} {e['p99']:7.1f}  "
            f"{s['errors'] or '-'}"
        )
    rows.append("(latencies in ms; TTFT over streamed requests; tok/s = prompt + completion tokens per second)")
    return "\n".join(rows)
