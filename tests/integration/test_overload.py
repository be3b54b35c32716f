"""#65 on the real engine: admission under load, callers who leave, deadlines (one eager server, its steps
slowed by the fault plugin so a handful of requests is an overload on any machine).

The server runs 4 requests at once (``--max-num-seqs 4``) and admits what it expects to start within 1 s
(``--guard-max-queue-wait 1``); with 50 ms steps a 16-token request takes about a second. The bench
(``vlguard bench compare --scenario overload``) measures the same at scale, side by side with stock.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import slow_steps_flag
from tests.helpers import metric, poll
from tests.servers import ServerProcess, engine_env, vlguard_argv

FLAGS = ("--enforce-eager", "--max-num-seqs", "4", "--guard-max-queue-wait", "1")
STEP_S = "0.05"


@pytest.fixture(scope="module")
def loaded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("logs")
    env = engine_env(VLGUARD_TEST_SLOW_STEPS_IF=str(logs / "slow-steps"))
    srv = ServerProcess(vlguard_argv(tiny_model, *FLAGS), logs / "overload.log", env=env)
    srv.start().wait_ready()
    slow_steps_flag(srv).write_text(STEP_S)
    yield srv
    srv.stop()


def _chat(model: str, max_tokens: int = 16, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Is the exit clear?"}],
            "max_tokens": max_tokens, "ignore_eos": True, **extra}  # fmt: skip


def _engine_idle(srv: ServerProcess) -> bool:
    return metric(srv, "vllm:num_requests_running") + metric(srv, "vllm:num_requests_waiting") == 0


async def _flood(srv: ServerProcess, model: str, count: int, every_s: float) -> list[tuple[int, float, str | None]]:
    """``count`` requests sent ``every_s`` apart (open loop): (status, seconds to the answer, Retry-After)."""
    async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=None)) as client:

        async def one(delay: float) -> tuple[int, float, str | None]:
            await asyncio.sleep(delay)
            started = time.monotonic()
            resp = await client.post("/v1/chat/completions", json=_chat(model))
            return resp.status_code, time.monotonic() - started, resp.headers.get("retry-after")

        return await asyncio.gather(*(one(i * every_s) for i in range(count)))


def test_a_flood_is_served_at_capacity_and_the_rest_refused_at_once(loaded: ServerProcess, model_name: str) -> None:
    asyncio.run(_flood(loaded, model_name, 8, 0.25))  # the engine's start rate measured once
    poll(lambda: _engine_idle(loaded), 60, "the engine idle after the warm-up")
    answers = asyncio.run(_flood(loaded, model_name, 60, 0.05))  # 20 a second for 3 s: several times capacity
    served = [s for s, _, _ in answers if s == 200]
    refused = [(took, retry) for s, took, retry in answers if s == 503]
    assert len(served) + len(refused) == len(answers), sorted({s for s, _, _ in answers})
    assert len(served) >= 8 and len(refused) >= 10, (len(served), len(refused))
    assert all(retry is not None and int(retry) >= 1 for _, retry in refused)
    assert statistics.median(took for took, _ in refused) < 0.25  # refused at the door, not after a wait
    assert max(took for s, took, _ in answers if s == 200) < 15  # an admitted request waited about the bound
    rejected = metric(loaded, "vlguard_requests_rejected_total")
    assert rejected >= len(refused)
    poll(lambda: _engine_idle(loaded), 60, "the engine idle after the flood")


def _leave_once_running(srv: ServerProcess, body: dict[str, object]) -> float:
    """Send ``body`` on a connection of its own and close it once the engine runs the request; seconds from
    the close until the engine runs nothing."""
    data = json.dumps(body).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", srv.port)) as conn:
        conn.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        poll(lambda: metric(srv, "vllm:num_requests_running") == 1, 60, "the request running")
        left = time.monotonic()  # the caller gives up: its connection closes
    poll(lambda: metric(srv, "vllm:num_requests_running") == 0, 10, "the engine running nothing", 0.02)
    return time.monotonic() - left


@pytest.mark.parametrize("stream", [False, True])
def test_a_caller_who_leaves_costs_the_engine_nothing_more(
    loaded: ServerProcess, model_name: str, stream: bool
) -> None:
    poll(lambda: _engine_idle(loaded), 60, "the engine idle")
    aborted = metric(loaded, "vlguard_aborted_tokens_total")
    assert _leave_once_running(loaded, _chat(model_name, max_tokens=400, stream=stream)) < 1.0
    poll(lambda: metric(loaded, "vlguard_aborted_tokens_total") > aborted, 10, "the abort's tokens counted")


def test_a_request_past_its_deadline_while_waiting_is_never_prefilled(loaded: ServerProcess, model_name: str) -> None:
    """Four long requests fill the engine; then the steps slow to 0.3 s, after the estimate admitted a fifth
    with a 2 s deadline. It waits behind them, gets its 504 at 2 s, and leaves the engine's queue without a
    prefill (the engine's prompt-token counter does not move)."""
    poll(lambda: _engine_idle(loaded), 60, "the engine idle")
    client = httpx.Client(base_url=loaded.url, timeout=120)
    statuses: list[int] = []

    def fill() -> None:
        statuses.append(client.post("/v1/chat/completions", json=_chat(model_name, max_tokens=40)).status_code)

    fillers = [threading.Thread(target=fill) for _ in range(4)]
    for t in fillers:
        t.start()
    poll(lambda: metric(loaded, "vllm:num_requests_running") == 4 or statuses, 60, "four requests running")
    assert metric(loaded, "vllm:num_requests_running") == 4, statuses
    generated = metric(loaded, "vllm:generation_tokens_total")
    poll(lambda: metric(loaded, "vllm:generation_tokens_total") >= generated + 8, 60, "the four prefilled")
    prompt_tokens = metric(loaded, "vllm:prompt_tokens_total")
    flag = slow_steps_flag(loaded)
    flag.write_text("0.3")
    try:
        started = time.monotonic()
        resp = httpx.post(loaded.url + "/v1/chat/completions", json=_chat(model_name),
                          headers={"X-Request-Timeout": "2"}, timeout=60)  # fmt: skip
        took = time.monotonic() - started
        assert resp.status_code == 504 and resp.json()["error"]["code"] == 504, resp.text  # admitted, then dropped
        assert 1.9 < took < 4, took
        poll(lambda: metric(loaded, "vllm:num_requests_waiting") == 0, 3, "the request out of the queue (a step)")
        assert metric(loaded, "vllm:prompt_tokens_total") == prompt_tokens
    finally:
        flag.write_text(STEP_S)
        for t in fillers:
            t.join()
        client.close()
