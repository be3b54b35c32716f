"""``vlguard bench compare --scenario front``: the API process's own CPU per request, stock's app against
vlguard's, with the engine core taken out of the measurement (#37).

End to end on a 2-core machine, stock against itself moves 8 % in throughput and 9 % in API CPU over a
run: the engine core and the API process share the cores, so a 2 % goal cannot be resolved there. Here
each system is only its API process: stock's app (vLLM's ``build_app`` + ``init_app_state``) and vlguard's
(``create_app``, guard and door included) each serve from a process of its own, over uvicorn on loopback,
with vLLM's real serving layer, tokenizer, chat template and image processor, over a :class:`NullEngine`
in place of the engine core (it answers ``max_tokens`` tokens at once, computing nothing). Three
systems run side by side: ``stock-a``, ``stock-b`` (the A/A pair: the resolution) and ``vlguard``, each
as one API process, or with ``--api-server-count N`` in the serve flags as N processes sharing one
listening socket (as ``vllm serve --api-server-count N`` runs its API servers; a system's CPU is then all
of its processes').

Each round sends the same block of two-pass pairs (images included, half the requests streamed) to each
process in turn, in an order that rotates every round, and reads the process's CPU time (user + system,
every thread) before and after: CPU per request. The ratio vlguard/stock-a and stock-b/stock-a are given
per round and as a 90 % t interval of their geometric mean over the rounds; the same for the event-loop
threads' part of it (each process's main thread, where uvicorn, the routes and vlguard's door and engine
client run), apart from the other threads: vLLM's workers (Hugging Face preprocessing, media loading), whose
CPU moves most between two stock processes, and in vlguard's process also the media policy's checks in
vLLM's loading threads, its replay cache in the renderer's and its decode pool. vlguard's own code per
request comes from the phase trace (:mod:`server.workload.phase_trace`) in its process, over
:data:`TRACED_BLOCKS` more blocks sent to it after the rounds: every process carries the tracer's
wrappers, and the rounds send no trace ids, so no system pays for writing a trace in the CPU compared.

What is left out, on purpose: the engine core, AsyncLLM's output processing and detokenization (both
systems share it unchanged; the null engine hands text over directly).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from server.workload import generator, phase_trace, report

SYSTEMS = ("stock-a", "vlguard", "stock-b")
#: Blocks of pairs sent to vlguard, traced, after the rounds (their CPU is not counted)
TRACED_BLOCKS = 4


class NullEngine:
    """The engine-client surface vLLM's serving layer and vlguard's supervisor use, over no engine core:
    ``generate`` yields ``max_tokens`` outputs at once (token ids from the prompt, a word of text each)."""

    def __init__(self, vllm_config: Any, renderer: Any, input_processor: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = input_processor
        self.errored = False
        self.dead_error = RuntimeError("the null engine does not die")
        self.engine_core = self
        self.is_running, self.is_stopped = True, False

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **_: Any) -> AsyncGenerator[Any, None]:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        ids = list(prompt.get("prompt_token_ids") or [0]) if isinstance(prompt, dict) else [0]
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        n = sampling_params.max_tokens or 16
        out: list[int] = []
        for i in range(n):
            out.append((sum(ids) + 31 * i) % 1000)
            new = out[-1:] if delta else list(out)
            finished = i == n - 1
            text = "".join(f" w{t}" for t in new)
            completion = CompletionOutput(index=0, text=text, token_ids=new, cumulative_logprob=None, logprobs=None,
                                          finish_reason="length" if finished else None)  # fmt: skip
            yield RequestOutput(request_id, None, ids, None, [completion], finished)
            await asyncio.sleep(0)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        return None

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        return None

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    async def reset_mm_cache(self) -> None:
        return None

    async def get_output_async(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def api_side_parts(model: str, flags: list[str], guard: bool) -> tuple[Any, Any, Any, Any, Any]:
    """``(args, settings, vllm_config, renderer, input_processor)``: the serve arguments as ``vlguard serve``
    parses them, and what ``AsyncLLM`` would build in this process over them (vlguard's engine arguments
    and its form of the processor cache when ``guard``; vLLM's own otherwise). Shared with the in-process
    API tests (``tests/inprocess.py``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from server.args import resolve_serve_args
    from server.serve import engine_args
    from server.vllm_hooks import processor_cache as replay_cache
    from server.vllm_hooks.locations import build_renderer_and_input_processor

    if guard:
        replay_cache.install()
    args, settings = resolve_serve_args(["serve", model, *flags])
    # Stock gets vLLM's own engine arguments; vlguard its overrides (as each one's serve builds them).
    built = engine_args(args, settings) if guard else AsyncEngineArgs.from_cli_args(args)
    vllm_config = built.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    renderer, input_processor = build_renderer_and_input_processor(vllm_config)
    return args, settings, vllm_config, renderer, input_processor


def _parts(model: str, flags: list[str], guard: bool) -> tuple[Any, Any, NullEngine]:
    """``(args, settings, engine)``: :func:`api_side_parts` with a null engine over them."""
    args, settings, vllm_config, renderer, input_processor = api_side_parts(model, flags, guard)
    return args, settings, NullEngine(vllm_config, renderer, input_processor)


def _stock_app(args: Any, engine: NullEngine) -> Any:
    """vLLM's own app (``build_app``), its state initialised over ``engine`` when it starts."""
    from server.vllm_hooks.locations import vllm_symbol

    app = vllm_symbol("build_app")(args, ("generate",))
    init_app_state = vllm_symbol("init_app_state")
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any) -> Any:
        await init_app_state(engine, app_.state, args, ("generate",))
        async with inner(app_):
            yield

    app.router.lifespan_context = lifespan
    return app


def _vlguard_app(args: Any, settings: Any, engine: NullEngine) -> Any:
    """vlguard's app (``create_app``) with its supervisor over ``engine``."""
    from server.app import create_app
    from server.guard.supervisor import Supervisor

    return create_app(args, settings, Supervisor(lambda: engine, settings))


def serve(system: str, model: str, fd: int, ready: Path, flags: list[str]) -> None:
    """Serve ``system`` (``stock*`` or ``vlguard``) on the listening socket ``fd`` (inherited, shared by the
    system's API processes as vLLM's are) until killed; ``ready`` is created once it serves. Phase-traced
    into ``$VLGUARD_PHASE_TRACE`` when set."""
    import uvicorn

    guard = system == "vlguard"
    args, settings, engine = _parts(model, flags, guard)
    app = _vlguard_app(args, settings, engine) if guard else _stock_app(args, engine)
    if trace := os.environ.get(phase_trace.ENV):
        phase_trace.install(trace, guard=guard)  # vlguard's door and engine client too
        phase_trace.trace_engine_client(NullEngine)
    # The same HTTP server settings for both: no access log (its cost would only blur the comparison).
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))

    def mark_ready() -> None:  # uvicorn says it serves only in a log line, and the log is at warning
        while not server.started:
            time.sleep(0.1)
        ready.touch()

    threading.Thread(target=mark_ready, daemon=True).start()
    server.run(sockets=[socket.socket(fileno=fd)])


def api_server_count(flags: list[str]) -> tuple[int, list[str]]:
    """``--api-server-count N`` (``-asc N``, as ``vllm serve`` spells it; 1 when absent) taken out of the
    serve flags: the scenario starts N API processes of each system itself.

    Raises:
        ValueError: N below 1.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--api-server-count", "-asc", type=int, default=1)
    known, rest = parser.parse_known_args(flags)
    if known.api_server_count < 1:
        raise ValueError(f"--api-server-count {known.api_server_count}: at least 1")
    return known.api_server_count, rest


@dataclass
class FrontResult:
    """Per system: CPU ms per request of each round; the rounds' ratios and their intervals."""

    cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    records: dict[str, list[generator.Record]] = field(default_factory=dict)
    own_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    own_cpu_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    rps: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    api_servers: int = 1  # API processes per system
    #: the event-loop threads' part of ``cpu_ms`` (each process's main thread: uvicorn's loop, where the
    #: front's own code runs); the rest is the other threads (vLLM's workers, and vlguard's work in them)
    loop_cpu_ms: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})

    def ratio(self, a: str, b: str, of: str = "cpu_ms") -> tuple[float, tuple[float, float]]:
        """The geometric mean of ``a``/``b`` over the rounds, and its 90 % t interval (``of``: ``cpu_ms``,
        CPU per request, ``loop_cpu_ms``, its event-loop threads' part, or ``rps``, requests served per
        second)."""
        figures: dict[str, list[float]] = getattr(self, of)
        per_round = [x / y for x, y in zip(figures[a], figures[b], strict=True) if y > 0]
        mean = math.exp(float(np.mean(np.log(per_round)))) if per_round else math.nan
        return mean, report.pair_interval(per_round, log=True)

    def added_ms(self, a: str, b: str, of: str = "cpu_ms") -> tuple[float, tuple[float, float]]:
        """The mean of ``a`` - ``b`` CPU ms per request over the rounds (``of``: ``cpu_ms`` or
        ``loop_cpu_ms``), and its 90 % t interval."""
        figures: dict[str, list[float]] = getattr(self, of)
        diffs = [x - y for x, y in zip(figures[a], figures[b], strict=True)]
        return float(np.mean(diffs)), report.pair_interval(diffs)


def _process_cpu_s(pid: int) -> tuple[float, float]:
    """``(all threads, main thread)`` CPU seconds of process ``pid`` (its main thread's id is its pid)."""
    process = psutil.Process(pid)
    times = process.cpu_times()
    main = next((t.user_time + t.system_time for t in process.threads() if t.id == pid), math.nan)
    return float(times.user + times.system), float(main)


def _cpu_s(procs: list[subprocess.Popen[bytes]]) -> tuple[float, float]:
    """``(all threads, main threads)`` CPU seconds of a system's processes."""
    each = [_process_cpu_s(proc.pid) for proc in procs]
    return sum(total for total, _ in each), sum(main for _, main in each)


def run(
    model: str,
    flags: list[str],
    out: Path,
    workload: generator.TwoPassConfig,
    rounds: int = 10,
    warmup: int = 1,
    pairs: int = 8,
    concurrency: int = 4,
    progress: bool = False,
) -> FrontResult:
    """Start the three systems (``--api-server-count N`` in ``flags``: N API processes each, on one socket),
    send ``warmup`` + ``rounds`` blocks of ``pairs`` pairs to each in rotating order, and measure their CPU
    per request (all of a system's processes). Writes each process's log and trace to ``out``.

    Raises:
        ValueError: ``--api-server-count`` below 1.
    """
    out.mkdir(parents=True, exist_ok=True)
    count, flags = api_server_count(flags)
    procs: dict[str, list[subprocess.Popen[bytes]]] = {}
    urls: dict[str, str] = {}
    try:
        for system in SYSTEMS:
            urls[system], procs[system] = _start(system, model, flags, out, count)
        for system, url in urls.items():
            _wait_ready(url, procs[system], out, system)
        plan = generator.TwoPassPlan(workload)
        result = FrontResult({s: [] for s in SYSTEMS}, {s: 0 for s in SYSTEMS}, {s: [] for s in SYSTEMS})
        for r in range(warmup + rounds):
            for system in report.rotation(SYSTEMS, r):
                before, loop_before = _cpu_s(procs[system])
                done = asyncio.run(
                    generator.run(
                        urls[system],
                        plan,
                        pairs=pairs,
                        first_pair=r * pairs,
                        concurrency=concurrency,
                        model=model,
                        progress=progress,
                    )
                )
                after, loop_after = _cpu_s(procs[system])
                if r >= warmup:
                    ms_each = 1000.0 / max(1, len(done.records))  # seconds of CPU -> ms per request
                    result.cpu_ms[system].append((after - before) * ms_each)
                    result.loop_cpu_ms[system].append((loop_after - loop_before) * ms_each)
                    result.rps[system].append(sum(rec.ok for rec in done.records) / max(done.wall_s, 1e-9))
                    result.failed[system] += sum(not rec.ok for rec in done.records)
                    result.records[system] += done.records
        # vlguard's own code, phase by phase, in blocks of their own: writing the trace costs CPU that the
        # rounds above would have charged to vlguard alone.
        traced = asyncio.run(
            generator.run(
                urls["vlguard"],
                plan,
                pairs=pairs * TRACED_BLOCKS,
                first_pair=(warmup + rounds) * pairs,
                concurrency=concurrency,
                model=model,
                progress=progress,
                trace=True,
            )
        )
        result.failed["vlguard"] += sum(not rec.ok for rec in traced.records)
        traces = [_file(out, "vlguard", i, count, "-trace.jsonl") for i in range(count)]  # a request is one process's
        events = {rid: points for path in traces for rid, points in phase_trace.read(path).items()}
        phases = report.trace_phases_ms(traced.records, events)
        result.own_ms = {name: phases[name] for name in report.GUARD_SHOWN_PHASES if name in phases}
        cpu = {rid: points for path in traces for rid, points in phase_trace.read_cpu(path).items()}
        result.own_cpu_ms = report.own_cpu_ms(traced.records, cpu)
        result.api_servers = count
        return result
    finally:
        for proc in (proc for started in procs.values() for proc in started):
            proc.kill()
            proc.wait(30)


def _file(out: Path, system: str, index: int, count: int, suffix: str) -> Path:
    """API process ``index`` of ``system``'s file ``suffix`` (``-trace.jsonl``, ``.log``, ``.ready``; no index
    for one)."""
    return out / f"compare-front-{system}{'' if count == 1 else f'-{index}'}{suffix}"


def _start(
    system: str, model: str, flags: list[str], out: Path, count: int
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """``count`` API processes of ``system`` on one listening socket on loopback: its URL and the processes."""
    with socket.create_server(("127.0.0.1", 0), backlog=1024) as listener:
        fd, port = listener.fileno(), listener.getsockname()[1]
        started = []
        for i in range(count):
            env = {**os.environ, "VLLM_PLUGINS": ""}  # neither loads vlguard's engine plugins: no engine here
            # Every process carries the tracer's wrappers (vlguard's own points too in vlguard's), so that
            # the untraced rounds pay the same for them; only the traced blocks write a trace.
            env[phase_trace.ENV] = str(_file(out, system, i, count, "-trace.jsonl"))
            Path(env[phase_trace.ENV]).write_bytes(b"")
            ready = _file(out, system, i, count, ".ready")
            ready.unlink(missing_ok=True)
            log = _file(out, system, i, count, ".log").open("wb")
            argv = [sys.executable, "-m", "server.workload.front", "serve", system, model, str(fd), str(ready),
                    "--", *flags]  # fmt: skip
            started.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(fd,)))
    return f"http://127.0.0.1:{port}", started


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], out: Path, system: str, timeout_s: float = 300) -> None:
    """Wait until every one of ``system``'s processes serves (its ready file) and ``url`` answers."""
    deadline = time.monotonic() + timeout_s
    marks = [_file(out, system, i, len(procs), ".ready") for i in range(len(procs))]
    while time.monotonic() < deadline:
        if failed := [proc for proc in procs if proc.poll() is not None]:
            raise RuntimeError(f"{system} ({url}): a process exited with {failed[0].returncode}; logs in {out}")
        try:
            if all(mark.exists() for mark in marks) and httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{system} ({url}) not ready after {timeout_s:g} s; logs in {out}")


def summary_lines(result: FrontResult) -> list[str]:
    """What ``vlguard bench compare --scenario front`` prints."""
    lines = []
    for system in SYSTEMS:
        ms = result.cpu_ms[system]
        lines.append(f"{system:8} API CPU per request: median {np.median(ms):.2f} ms over {len(ms)} rounds "
                     f"(min {min(ms):.2f}, max {max(ms):.2f}); failed {result.failed[system]}")  # fmt: skip
    for a, b, what in (("vlguard", "stock-a", "vlguard/stock"), ("stock-b", "stock-a", "A/A (stock/stock)")):
        ratio, (low, high) = result.ratio(a, b)
        added, (dlow, dhigh) = result.added_ms(a, b)
        lines.append(f"{what:18} CPU per request ratio {ratio:.3f} (90 % interval {low:.3f}-{high:.3f}); "
                     f"added {added:+.2f} ms ({dlow:+.2f} to {dhigh:+.2f})")  # fmt: skip
    if all(result.loop_cpu_ms[system] for system in SYSTEMS):
        for system in SYSTEMS:
            loop, rest = np.median(result.loop_cpu_ms[system]), np.median(result.cpu_ms[system])
            lines.append(f"{system:8} event-loop thread CPU per request: median {loop:.2f} ms "
                         f"(the other threads: {rest - loop:.2f})")  # fmt: skip
        for a, b, what in (("vlguard", "stock-a", "vlguard/stock"), ("stock-b", "stock-a", "A/A (stock/stock)")):
            ratio, (low, high) = result.ratio(a, b, of="loop_cpu_ms")
            added, (dlow, dhigh) = result.added_ms(a, b, of="loop_cpu_ms")
            lines.append(f"{what:18} event-loop CPU ratio {ratio:.3f} (90 % interval {low:.3f}-{high:.3f}); "
                         f"added {added:+.2f} ms ({dlow:+.2f} to {dhigh:+.2f})")  # fmt: skip
    each = f" ({result.api_servers} API processes)" if result.api_servers > 1 else ""
    for system in SYSTEMS:
        rps = np.median(result.rps[system])
        lines.append(f"{system:8} front throughput{each}: median {rps:.1f} requests/s a block")
    for a, b, what in (("vlguard", "stock-a", "vlguard/stock"), ("stock-b", "stock-a", "A/A (stock/stock)")):
        ratio, (low, high) = result.ratio(a, b, of="rps")
        lines.append(f"{what:18} throughput ratio {ratio:.3f} (90 % interval {low:.3f}-{high:.3f})")
    if result.own_ms:
        lines.append("vlguard's own code per streamed request (phase trace, p50 / mean ms): " + ", ".join(
            f"{name} {v['p50']:.3f} / {v['mean']:.3f}" for name, v in result.own_ms.items()))  # fmt: skip
    if result.own_cpu_ms:
        lines.append("  the same phases' CPU (thread CPU time, p50 / mean ms): " + ", ".join(
            f"{name} {v['p50']:.3f} / {v['mean']:.3f}" for name, v in result.own_cpu_ms.items()))  # fmt: skip
        own, moved = report.added_p50(result.own_cpu_ms)
        lines.append(f"  vlguard's own code, CPU (sum of p50s): {own:.3f} ms; of it vLLM's work done once in "
                     f"vlguard's code instead {moved:.3f}; added by vlguard {own - moved:.3f}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m server.workload.front serve SYSTEM MODEL FD READY -- FLAGS``: one API process of a system."""
    parser = argparse.ArgumentParser(prog="python -m server.workload.front")
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve")
    srv.add_argument("system", choices=SYSTEMS)
    srv.add_argument("model")
    srv.add_argument("fd", type=int, help="the listening socket, inherited")
    srv.add_argument("ready", type=Path, help="created once the process serves")
    srv.add_argument("flags", nargs="*")
    args = parser.parse_args(argv)
    serve(args.system, args.model, args.fd, args.ready, args.flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
