"""``vlguard bench compare --scenario poison``: one client keeps sending poison while others work.

vlguard serves the two-pass workload (``--concurrency`` clients in flight, API key ``innocent``) while one
client (API key ``poison``) sends a request that faults the engine core every ``--fault-every`` seconds
for ``--fault-duration`` seconds, each one varied (a new fingerprint, so the quarantine alone cannot stop
it). The fault is real: the test fault plugin (``tests/plugins``, development environments only) makes the
scheduler raise while it admits a request holding a marker word, inside ``schedule()`` and outside any
model step, as a grammar that fails to compile does. The same run is made twice, side by side: vlguard as
configured (per-client fault budget on) and with ``--guard-client-fault-max 0`` (quarantine only).

Printed per system: innocent requests failed (goal 0), soft recoveries and rebuilds (goal 0), faults the
poison client caused and how its requests were answered, the restart budget left, the API process's
peak resident memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

import httpx

from server.workload import generator, report
from server.workload.compare import CompareOptions, System, system_server
from server.workload.servers import ServerProcess, metric_samples, rss_peak

#: The marker the fault plugin is armed with (``VLGUARD_TEST_POISON_ADMIT_TOKENS`` holds its token ids).
MARKER = " Quokkatambourinemarker"
KEYS = ("--api-key", "innocent", "poison")
SYSTEMS = (
    System("budget", guard_args=KEYS),
    System("no-budget", guard_args=(*KEYS, "--guard-client-fault-max", "0")),
)


def poison_env(model: str) -> dict[str, str]:
    """The environment that arms the admission fault for ``MARKER`` under ``model``'s tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).encode(MARKER, add_special_tokens=False)
    return {"VLGUARD_TEST_POISON_ADMIT_TOKENS": ",".join(map(str, ids))}


async def _poison_client(url: str, model: str, every_s: float, stop: asyncio.Event) -> collections.Counter[int]:
    """Every ``every_s`` seconds until ``stop``, a new poison request (not awaited before the next one);
    returns how many were answered with each status (0: no answer)."""
    answers: collections.Counter[int] = collections.Counter()
    pending: set[asyncio.Task[None]] = set()
    headers = {"Authorization": "Bearer poison"}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:

        async def send(n: int) -> None:
            text = f"Variant {n} with seed {n * 7919}:{MARKER} now."
            body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
            try:
                answers[(await client.post("/v1/chat/completions", json=body)).status_code] += 1
            except httpx.HTTPError:
                answers[0] += 1

        n = 0
        while not stop.is_set():
            task = asyncio.create_task(send(n))
            pending.add(task)
            task.add_done_callback(pending.discard)
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
        await asyncio.gather(*pending, return_exceptions=True)
    return answers


async def _run(srv: ServerProcess, opts: CompareOptions) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": "Bearer innocent"}) as client:
        model = (await client.get(srv.url + "/v1/models")).json()["data"][0]["id"]
    before = metric_samples(srv.url, "vlguard_", by_label="kind")
    assert srv.proc is not None
    stop = asyncio.Event()
    with rss_peak(srv.proc.pid) as peak:
        poisoner = asyncio.create_task(_poison_client(srv.url, model, opts.fault_every_s, stop))
        try:
            res = await generator.run(srv.url, generator.TwoPassPlan(opts.workload),
                                      duration_s=opts.fault_duration_s, concurrency=opts.concurrency, model=model,
                                      api_key="innocent", progress=opts.progress)  # fmt: skip
        finally:
            stop.set()
            answers = await poisoner
    after = metric_samples(srv.url, "vlguard_", by_label="kind")

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    summary = report.summarize(res.records, res.wall_s)
    restarts = delta("vlguard_engine_restarts_total")
    return {
        "summary": summary,
        "innocent_failed": summary["failed"],
        "soft_recoveries": delta("vlguard_engine_recoveries_total{soft}"),
        "rebuilds": delta("vlguard_engine_recoveries_total{rebuild}"),
        "engine_faults": delta("vlguard_engine_deaths_total"),
        "poison_sent": sum(answers.values()),
        "poison_answers": dict(sorted(answers.items())),
        "poison_client_faults": delta("vlguard_client_faults_total"),
        "restart_budget_left": after.get("vlguard_engine_restart_budget", 0.0) - restarts,
        "api_rss_peak_mb": peak[0] / 2**20,
    }


def poison(opts: CompareOptions) -> dict[str, Any]:
    """Run the poison scenario (see the module docstring) on each system in turn; returns per system the
    figures printed."""
    env = poison_env(opts.model)
    results: dict[str, Any] = {}
    for system in SYSTEMS:
        srv = system_server(system, opts, extra_env=env)
        try:
            srv.start().wait_ready(opts.ready_timeout_s)
            results[system.name] = asyncio.run(_run(srv, opts))
        finally:
            srv.stop()
    return {"systems": results}
