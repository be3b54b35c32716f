"""CASES C5 on every engine lane: ``kill -9`` of the real engine core with 32 requests in flight; and #15's
soft recovery of a step exception with image requests and streams in flight.

It runs on the session's eager server (its engine is rebuilt in place; later tests see a fresh engine with
the same deterministic outputs), so no engine lane pays a launch of its own for it. The other real faults
(hang, poison, repeated kills, resumed streams) are in test_guard.py, on the default lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from server.workload.images import photo_uri
from server.workload.twopass import primary_messages
from tests.conftest import EAGER_ADMIT_WORD, EAGER_POISON_WORD, drop_mm_cache_flag, slow_steps_flag
from tests.helpers import (
    carried_over,
    engine_core,
    gone,
    labelled,
    metric,
    poll,
    process_name,
    spare_events,
    spare_processes,
    sse_tokens,
    stall_engine,
    wait_spare_ready,
)
from tests.servers import ServerProcess

pytestmark = pytest.mark.lane  # in every engine lane's focused suite

REFUSED = -1


def ready_transitions(srv: ServerProcess, stop: threading.Event, seen: list[int]) -> None:
    """Poll /ready until ``stop``; record each distinct status in order, ``REFUSED`` for a refused connection.

    A keep-alive connection the server closed between two polls is retried, not counted.
    """
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            try:
                status = client.get(srv.url + "/ready").status_code
            except httpx.ConnectError:
                status = REFUSED
            except httpx.RemoteProtocolError:
                continue
            if not seen or seen[-1] != status:
                seen.append(status)
            time.sleep(0.1)


async def wait_inflight(srv: ServerProcess, n: int, timeout_s: float = 120) -> None:
    """Wait until ``n`` requests are inside the engine at once; the failure gives the most seen and the
    server log's tail. The scrape runs in a thread: a blocking call on this event loop would hold back the
    requests' own tasks."""
    deadline, most = time.monotonic() + timeout_s, 0.0
    while (now := await asyncio.to_thread(metric, srv, "vlguard_requests_inflight")) < n:
        most = max(most, now)
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} requests never were in the engine at once (at most {most:g}, now {now:g})\n"
                                 f"{srv.log_tail(40)}")  # fmt: skip
        await asyncio.sleep(0.05)


async def _chat(client: httpx.AsyncClient, body: dict[str, object]) -> tuple[int, list[int], str | None]:
    """One chat request; for streams, the token ids received and the error event's message, if any."""
    if not body.get("stream"):
        resp = await client.post("/v1/chat/completions", json=body)
        return resp.status_code, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        return resp.status_code, *sse_tokens([line async for line in resp.aiter_lines()])


async def test_kill_engine_core_with_32_requests_in_flight(eager_server: ServerProcess, model_name: str) -> None:
    """CASES C5: SIGKILL of the engine core with 32 requests inside the engine (16 non-streaming, 16 streams;
    half with an image): every non-streaming request 200, streams complete or end with an error event,
    /ready 200 -> 503 -> 200 and never refused, one death, every request carried over. #18: the rebuild's
    engine core and worker are the spare processes (no process start or import on its critical path).
    #16: the image requests are processor-cache hits (the photo was sent first), so their replays on the
    new engine core need the image data vLLM's cache kept (vLLM's own split cache would have sent them
    without it: "Expected a cached item"); after the rebuild vLLM's cache metrics still count."""
    image = photo_uri("chelsea.png")
    wait_spare_ready(eager_server)
    deaths_before, carried = metric(eager_server, "vlguard_engine_deaths_total"), carried_over(eager_server)
    spares, log_at = spare_events(eager_server), eager_server.log_path.stat().st_size
    old_core = engine_core(eager_server)
    n_tokens = 512

    def body(i: int, stream: bool) -> dict[str, object]:
        messages = primary_messages(image) if i % 2 else [{"role": "user", "content": f"Safety report {i}."}]
        extra = {"logprobs": True, "return_tokens_as_token_ids": True} if stream else {}
        return {"model": model_name, "messages": messages, "max_tokens": n_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream, **extra}  # fmt: skip

    stop, seen = threading.Event(), []  # type: ignore[var-annotated]
    watcher = threading.Thread(target=ready_transitions, args=(eager_server, stop, seen), daemon=True)
    watcher.start()
    limits = httpx.Limits(max_connections=64)
    worker: psutil.Process | None = None
    slow = slow_steps_flag(eager_server)
    try:
        async with httpx.AsyncClient(base_url=eager_server.url, timeout=600, limits=limits) as client:
            assert (await _chat(client, {**body(1, stream=False), "max_tokens": 1}))[0] == 200  # cached now
            hits = await asyncio.to_thread(metric, eager_server, "vllm:mm_cache_hits_total")
            # No request may finish before all 32 are in: every step is 25 ms slower (>= 12.8 s a request)
            # until half are in, then the engine's worker is stopped. (Without the slow steps, the tiny
            # model's first requests sometimes finished, in 2-3 s, before the stall: at most 24 or 31 of
            # the 32 were then ever in flight at once.)
            slow.touch()
            tasks = [asyncio.create_task(_chat(client, body(i, stream=i >= 16))) for i in range(32)]
            await wait_inflight(eager_server, 16)
            worker = stall_engine(old_core)
            slow.unlink()  # the replays run at full speed
            # Well inside the guard's hang timeout (60 s): past it, the guard itself would end the stall.
            await wait_inflight(eager_server, 32, timeout_s=40)
            old_core.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
        poll(lambda: httpx.get(eager_server.url + "/ready").status_code == 200, 300, "ready again")
    finally:
        slow.unlink(missing_ok=True)
        stop.set()
        watcher.join()
        stalled_worker_left = worker is not None and not gone(worker)
        if stalled_worker_left:  # never leave a stopped process behind, whatever failed
            with contextlib.suppress(psutil.Error):
                worker.kill()

    plain, streams = results[:16], results[16:]
    assert [status for status, _, _ in plain] == [200] * 16
    for status, ids, error in streams:
        assert status == 200
        assert (error is None and len(ids) == n_tokens) or error is not None, (len(ids), error)
    assert seen[0] == 200 and 503 in seen and seen[-1] == 200 and REFUSED not in seen, seen
    assert metric(eager_server, "vlguard_engine_deaths_total") == deaths_before + 1
    assert metric(eager_server, "vlguard_engine_restarts_total") >= 1
    assert carried_over(eager_server) >= carried + 32
    assert gone(old_core) and not stalled_worker_left  # the guard killed the killed core's stopped worker
    assert engine_core(eager_server).pid != old_core.pid  # exactly one engine core: no orphans
    assert spare_events(eager_server).get("used", 0) == spares.get("used", 0) + 1
    with eager_server.log_path.open("rb") as log:
        log.seek(log_at)
        rebuild_log = log.read().decode(errors="replace")
    assert "EngineCore runs in spare process" in rebuild_log
    assert "VllmWorker-0 runs in spare process" in rebuild_log
    # The 16 image requests were cache hits, counted by vLLM's metrics, and the rebuilt engine counts on.
    assert metric(eager_server, "vllm:mm_cache_hits_total") >= hits + 16
    counted = ("vllm:mm_cache_queries_total", "vllm:prefix_cache_queries_total")
    before = {name: metric(eager_server, name) for name in counted}
    async with httpx.AsyncClient(base_url=eager_server.url, timeout=120) as client:
        assert (await _chat(client, {**body(1, stream=False), "max_tokens": 1}))[0] == 200
    for name in counted:
        poll(lambda: metric(eager_server, name) > before[name], 30, f"{name} to count the request")  # noqa: B023


@pytest.mark.full_only  # the keeper is vLLM-agnostic; each lane's hand-over is checked by the C5 test above
def test_a_killed_spare_is_replaced_and_counted_without_touching_serving(
    eager_server: ServerProcess, model_name: str
) -> None:
    """#18: SIGKILL of the spare engine process: its worker spare ends with it, a new spare is spawned
    (after a 10 s back-off), the death is counted, and the engine keeps serving.

    The spare is killed once it has spawned its worker spare, importing or ready alike (the keeper treats
    both the same; waiting for the imports cost this test 20-30 s after C5's rebuild used the last spare).
    """

    def spare_pair() -> tuple[psutil.Process, list[psutil.Process]] | None:
        with contextlib.suppress(psutil.Error):  # a process that ended while we looked: look again
            cores = [p for p in spare_processes(eager_server) if p.ppid() == eager_server.proc.pid]  # type: ignore[union-attr]
            workers = [c for c in cores[0].children() if process_name(c) == "vlguard::spare"] if cores else []
            return (cores[0], workers) if workers else None
        return None

    core_spare, worker_spares = poll(spare_pair, 120, "a spare engine process and its worker spare")
    before, deaths = spare_events(eager_server), metric(eager_server, "vlguard_engine_deaths_total")
    core_spare.kill()
    body = {"model": model_name, "messages": [{"role": "user", "content": "Status?"}], "max_tokens": 4}
    assert httpx.post(eager_server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    poll(lambda: spare_events(eager_server).get("died", 0) == before.get("died", 0) + 1, 30, "the death counted")
    # Orphaned, it ends through its own parent watch (0.5 s polls, perhaps in the middle of its imports).
    poll(lambda: all(gone(p) for p in worker_spares), 30, "the dead spare's worker spare to end")
    # Replaced after the back-off (10 s); its readiness is the C5 test's (it waits for a ready spare).
    poll(lambda: spare_events(eager_server).get("spawned", 0) == before.get("spawned", 0) + 1, 60, "a new spare")
    poll(lambda: [p for p in spare_processes(eager_server) if p.pid != core_spare.pid], 30, "the new spare process")
    assert metric(eager_server, "vlguard_engine_deaths_total") == deaths  # the engine never noticed


async def test_step_fault_with_requests_in_flight_is_absorbed(eager_server: ServerProcess, model_name: str) -> None:
    """#15 on every lane: the model raises in the worker for one request while 8 others (images and text,
    streams and not) are in the engine (it is sent once the 4 streams are decoding). The engine absorbs it
    (no rebuild), every other request is served with the same greedy output as an uninterrupted run, and
    the faulting request is quarantined (400) after its second fault.

    Until the poison's first fault, each step is 25 ms slower (the fault plugin's slow-steps flag): the eight
    are in the engine for at least 256 x 25 ms = 6.4 s after the streams start, however fast the machine
    (long requests instead cost 2 minutes a lane, mostly replayed one by one in probation, and once still
    finished first)."""
    image = photo_uri("chelsea.png")
    n_tokens = 256

    def body(i: int) -> dict[str, object]:
        messages = primary_messages(image) if i % 2 else [{"role": "user", "content": f"Site report {i}."}]
        return {"model": model_name, "messages": messages, "max_tokens": n_tokens, "temperature": 0,
                "ignore_eos": True, "stream": i >= 4, "logprobs": True, "return_tokens_as_token_ids": True}  # fmt: skip

    started = [asyncio.Event() for _ in range(8)]

    def recoveries() -> dict[str, float]:
        return labelled(eager_server, "vlguard_engine_recoveries_total", "kind")

    async def answer(client: httpx.AsyncClient, i: int) -> tuple[int, object]:
        if i < 4:
            resp = await client.post("/v1/chat/completions", json=body(i))
            return resp.status_code, resp.json()["choices"][0]["message"]["content"]
        async with client.stream("POST", "/v1/chat/completions", json=body(i)) as resp:
            lines = []
            async for line in resp.aiter_lines():
                lines.append(line)
                if sse_tokens([line])[0]:
                    started[i].set()  # this stream is decoding in the engine
            return resp.status_code, sse_tokens(lines)

    async with httpx.AsyncClient(base_url=eager_server.url, timeout=600) as client:
        reference = await asyncio.gather(*(answer(client, i) for i in range(8)))
        before = recoveries()
        carried = await asyncio.to_thread(carried_over, eager_server)
        for event in started:
            event.clear()
        slow = slow_steps_flag(eager_server)
        slow.touch()
        try:
            tasks = [asyncio.create_task(answer(client, i)) for i in range(8)]
            # The 4 streams are decoding (the 4 requests sent with them are in the engine too, or nearly).
            await asyncio.wait_for(asyncio.gather(*(started[i].wait() for i in range(4, 8))), 120)
            poison = {"model": model_name, "max_tokens": 4,
                      "messages": [{"role": "user", "content": f"Please check{EAGER_POISON_WORD} now."}]}  # fmt: skip
            refusal = asyncio.create_task(client.post("/v1/chat/completions", json=poison))
            await asyncio.to_thread(poll, lambda: recoveries()["soft"] > before["soft"], 120, "the first fault")
        finally:
            slow.unlink(missing_ok=True)  # what was cut is replayed one by one (probation): at full speed
        refused = await refusal
        results = await asyncio.gather(*tasks)
    assert refused.status_code == 400 and "quarantined" in refused.json()["error"]["message"]
    assert results == reference
    after = recoveries()
    assert (after["soft"] - before["soft"], after["rebuild"] - before["rebuild"]) == (2, 0)
    # The poison's own replay is one; at least one other request in flight was cut and carried over.
    assert carried_over(eager_server) >= carried + 2


def test_a_fault_while_admitting_is_charged_to_that_request(eager_server: ServerProcess, model_name: str) -> None:
    """#33 on every lane: the scheduler raises while it admits one request (inside ``schedule()``, no model
    step: charged to nobody before, so it cost a rebuild and a 503). The traceback names the request: it
    alone is charged, gets 400 after two soft recoveries, no rebuild; its neighbours are served."""
    before = labelled(eager_server, "vlguard_engine_recoveries_total", "kind")
    poison = [{"role": "user", "content": f"Please check{EAGER_ADMIT_WORD} now."}]
    good = [[{"role": "user", "content": f"Is hatch {i} closed?"}] for i in range(4)]
    with httpx.Client(base_url=eager_server.url, timeout=120) as client, ThreadPoolExecutor(5) as pool:
        others = [pool.submit(client.post, "/v1/chat/completions", json={"model": model_name, "messages": m,
                  "max_tokens": 8, "ignore_eos": True}) for m in good]  # fmt: skip
        refused = client.post("/v1/chat/completions", json={"model": model_name, "messages": poison, "max_tokens": 4})
        assert [f.result().status_code for f in others] == [200] * 4
    assert refused.status_code == 400 and "quarantined" in refused.json()["error"]["message"]
    after = labelled(eager_server, "vlguard_engine_recoveries_total", "kind")
    assert (after["soft"] - before["soft"], after["rebuild"] - before["rebuild"]) == (2, 0)


async def test_an_engine_core_missing_a_cached_image_gets_it_sent_again(
    eager_server: ServerProcess, model_name: str
) -> None:
    """#16 on every lane: the guard sends an image the engine core holds as its hash; when the engine
    core's cache has drifted from the guard's shadow of it (here: the fault plugin empties it before each
    request), vLLM finishes the request with an error before any token, and the guard sends it again with
    the image: the client sees the same answer as without the drift (a stream and a non-streaming request),
    no engine fault, and ``vlguard_mm_cache_resends_total`` counts each."""
    image = photo_uri("coffee.png")

    def body(stream: bool) -> dict[str, object]:
        return {"model": model_name, "messages": primary_messages(image), "max_tokens": 8, "temperature": 0,
                "stream": stream, "logprobs": True, "return_tokens_as_token_ids": True}  # fmt: skip

    async def answer(client: httpx.AsyncClient, stream: bool) -> tuple[int, object]:
        if not stream:
            resp = await client.post("/v1/chat/completions", json=body(stream))
            return resp.status_code, [t["token"] for t in resp.json()["choices"][0]["logprobs"]["content"]]
        async with client.stream("POST", "/v1/chat/completions", json=body(stream)) as resp:
            return resp.status_code, sse_tokens([line async for line in resp.aiter_lines()])

    deaths = metric(eager_server, "vlguard_engine_deaths_total")
    async with httpx.AsyncClient(base_url=eager_server.url, timeout=300) as client:
        reference = [await answer(client, stream) for stream in (False, True)]  # the image is held now
        resends = await asyncio.to_thread(metric, eager_server, "vlguard_mm_cache_resends_total")
        drop = drop_mm_cache_flag(eager_server)
        drop.touch()
        try:
            drifted = [await answer(client, stream) for stream in (False, True)]
        finally:
            drop.unlink()
    assert reference[0][0] == 200 and len(reference[0][1]) == 8  # type: ignore[arg-type]
    assert drifted == reference
    assert metric(eager_server, "vlguard_mm_cache_resends_total") == resends + 2
    assert metric(eager_server, "vlguard_engine_deaths_total") == deaths
