"""``vlguard bench compare --scenario fault``: the same step fault injected into three systems, one run.

Systems: vlguard with soft recovery (default), vlguard with ``--guard-soft-recovery off`` (every fault
rebuilds the engine), and the stock vLLM OpenAI server restarted at once when it exits (as systemd's
``Restart=always`` would). The fault is real: the test fault plugin (``tests/plugins``, development
environments only) makes the model runner raise in the worker for any prompt holding a marker word, the
way a poison input does. Every ``fault_every_s`` seconds one such request (a new one each time, so the
quarantine does not refuse it at the door) is sent beside the two-pass load.

A fault is injected only while the system is ready (``/ready``, stock: ``/health``): a system still
recovering gets no new one. Per system: the load without faults (baseline), then the same load with
faults; reported: faults injected, time from each fault to the first success of a load request sent
after it, failed load requests, and throughput with faults / without.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httpx

from server.workload import generator, report
from server.workload.compare import CompareOptions, System, restart_on_exit, system_server
from server.workload.servers import ServerProcess

#: The marker the fault plugin is armed with (``VLGUARD_TEST_POISON_TOKENS`` holds its token ids).
MARKER = " Xylophonequartzmarker"
SYSTEMS = (
    System("soft"),
    System("rebuild", guard_args=("--guard-soft-recovery", "off")),
    System("stock", stock=True),
)


def fault_env(model: str) -> dict[str, str]:
    """The environment that arms the fault plugin for ``MARKER`` under ``model``'s tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).encode(MARKER, add_special_tokens=False)
    return {"VLGUARD_TEST_POISON_TOKENS": ",".join(map(str, ids))}


async def _inject(
    url: str, model: str, every_s: float, started_at: float, stop: asyncio.Event, ready_path: str
) -> list[float]:
    """Every ``every_s`` seconds until ``stop``, send a poison request if the system is ready (a system
    still recovering from the last fault gets no new one); returns when each was sent, seconds from
    ``started_at``. Poison requests still pending at ``stop`` are cancelled."""
    injected: list[float] = []
    pending: set[asyncio.Task[httpx.Response]] = set()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                break
            except TimeoutError:
                pass
            try:
                ready = (await client.get(ready_path, timeout=5)).status_code == 200
            except httpx.HTTPError:
                ready = False
            if not ready:
                continue
            body = {"model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"Fault {len(injected)}:{MARKER} now."}]}  # fmt: skip
            injected.append(time.monotonic() - started_at)
            pending.add(asyncio.create_task(client.post("/v1/chat/completions", json=body)))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return injected


async def _run(srv: ServerProcess, system: System, opts: CompareOptions, faults: bool) -> dict[str, Any]:
    plan = generator.TwoPassPlan(opts.workload)
    async with httpx.AsyncClient(timeout=30) as client:
        model = (await client.get(srv.url + "/v1/models")).json()["data"][0]["id"]

    stop = asyncio.Event()
    supervisor = asyncio.create_task(restart_on_exit(srv, system))
    started_at = time.monotonic()
    ready_path = "/health" if system.stock else "/ready"
    injector = (
        asyncio.create_task(_inject(srv.url, model, opts.fault_every_s, started_at, stop, ready_path))
        if faults
        else None
    )
    try:
        # Fresh pairs for each run (no prefix-cache hits from the other run); probes use others again.
        res = await generator.run(srv.url, plan, duration_s=opts.fault_duration_s, concurrency=opts.concurrency,
                                  first_pair=1000 if faults else 0, model=model, progress=opts.progress)  # fmt: skip
        stop.set()
        injected = await injector if injector is not None else []
        shift = res.started_at - started_at  # onto the load's clock
        injected = [t - shift for t in injected]
        recovery = []
        for at in injected:
            after = [r.start_s + r.e2e_s - at for r in res.records if r.ok and r.start_s > at]
            if not after:  # the load ended first (a restarting stock server): probe until one succeeds
                ok_at = await _first_success_at(srv, plan, model, opts)
                after = [ok_at - res.started_at - at] if ok_at is not None else [float("inf")]
            recovery.append(min(after))
    finally:
        stop.set()
        supervisor.cancel()
    return {"summary": report.summarize(res.records, res.wall_s), "faults_s": injected, "recovery_s": recovery}


async def _first_success_at(
    srv: ServerProcess, plan: generator.TwoPassPlan, model: str, opts: CompareOptions
) -> float | None:
    """``time.monotonic()`` when the first of a series of probe pairs succeeded (None: not within the
    ready timeout)."""
    deadline = time.monotonic() + opts.ready_timeout_s
    probe = 100_000  # pairs no load run uses
    while time.monotonic() < deadline:
        extra = await generator.run(srv.url, plan, pairs=1, first_pair=probe, concurrency=1, model=model,
                                    progress=False)  # fmt: skip
        ok = [extra.started_at + r.start_s + r.e2e_s for r in extra.records if r.ok]
        if ok:
            return min(ok)
        probe += 1
        await asyncio.sleep(0.5)
    return None


def fault(opts: CompareOptions) -> dict[str, Any]:
    """Run the fault scenario (see the module docstring); returns per system: baseline and faulted
    summaries, fault times, recovery times, and the throughput ratio."""
    env = fault_env(opts.model)
    servers = {s.name: system_server(s, opts, extra_env=env, stock_plugins="vlguard_test_faults") for s in SYSTEMS}
    results: dict[str, dict[str, Any]] = {}
    try:
        for srv in servers.values():  # one at a time: CPU engines started together bind the same core
            srv.start().wait_ready(opts.ready_timeout_s)
            srv.pause()
        for system in SYSTEMS:
            srv = servers[system.name]
            srv.resume()
            baseline = asyncio.run(_run(srv, system, opts, faults=False))
            faulted = asyncio.run(_run(srv, system, opts, faults=True))
            srv.pause()
            base_tps, fault_tps = baseline["summary"]["tokens_per_s"], faulted["summary"]["tokens_per_s"]
            results[system.name] = {
                "baseline": baseline["summary"],
                "faulted": faulted["summary"],
                "faults_s": faulted["faults_s"],
                "recovery_s": faulted["recovery_s"],
                "first_success_after_fault_s": {
                    "median": statistics.median(faulted["recovery_s"]) if faulted["recovery_s"] else None,
                    "max": max(faulted["recovery_s"]) if faulted["recovery_s"] else None,
                },
                "throughput_ratio": fault_tps / base_tps if base_tps else float("nan"),
            }
    finally:
        for srv in servers.values():
            srv.stop()
    return {"systems": results}
