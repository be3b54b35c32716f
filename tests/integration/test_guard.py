"""The engine guard under real faults on the real CPU engine (CASES C5, C6, C7).

Faults: SIGKILL and SIGSTOP of the real ``VLLM::EngineCore`` process, a test plugin that makes the real
model runner raise on a marker prompt, and one that makes engine start-up fail. Every wait is a
readiness or metrics poll with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from server.workload.images import photo_uri
from server.workload.twopass import primary_messages
from tests.notify import NotifySocket
from tests.servers import ServerProcess, engine_env, vlguard_argv

POISON_WORD = " Xylophonequartzmarker"
GUARD_FLAGS = (
    "--enforce-eager",
    "--guard-hang-timeout", "10",
    "--guard-watchdog-interval", "0.5",
    "--guard-ready-probe-interval", "2",
    "--guard-quarantine-deaths", "2",
    "--guard-restart-max", "20",
)  # fmt: skip


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) if proc.status() != psutil.STATUS_ZOMBIE else ""
    except psutil.Error:  # gone while we looked
        return ""


def engine_core(srv: ServerProcess, timeout_s: float = 30) -> psutil.Process:
    """The server's one live engine-core process (waits while a replaced one is still being reaped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cores = [p for p in srv.children() if "EngineCore" in _cmdline(p)]
        if len(cores) == 1 or time.monotonic() > deadline:
            assert len(cores) == 1, cores
            return cores[0]
        time.sleep(0.2)


def metric(srv: ServerProcess, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_until(predicate: object, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


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


@pytest.fixture(scope="module")
def poison_ids(tiny_model: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(tiny_model).encode(POISON_WORD, add_special_tokens=False))


@pytest.fixture(scope="module")
def notify(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path_factory.mktemp("notify") / "notify.sock")
    yield sock
    sock.close()


@pytest.fixture(scope="module")
def guarded(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, poison_ids: list[int], notify: NotifySocket
) -> Iterator[ServerProcess]:
    env = engine_env(
        VLGUARD_TEST_POISON_TOKENS=",".join(map(str, poison_ids)),
        NOTIFY_SOCKET=str(notify.path),
        WATCHDOG_USEC="2000000",
    )
    srv = ServerProcess(vlguard_argv(tiny_model, *GUARD_FLAGS), tmp_path_factory.mktemp("logs") / "guard.log", env=env)
    srv.start().wait_ready()
    yield srv
    srv.stop()


def client_for(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def stream_tokens(srv: ServerProcess, model: str, messages: list[dict[str, object]], max_tokens: int,
                  on_token: threading.Event | None = None, after: int = 1) -> tuple[list[int], str | None]:  # fmt: skip
    """Greedy stream with token ids; returns ``(token_ids, error_message_or_None)``."""
    ids: list[int] = []
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "logprobs": True, "ignore_eos": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return ids, chunk["error"]["message"]
            for choice in chunk.get("choices", []):
                for lp in (choice.get("logprobs") or {}).get("content") or []:
                    ids.append(int(lp["token"].removeprefix("token_id:")))
            if on_token is not None and len(ids) >= after:
                on_token.set()
    return ids, None


def test_systemd_ready_and_watchdog(guarded: ServerProcess, notify: NotifySocket) -> None:
    notify.wait_for("READY=1")
    notify.wait_for("WATCHDOG=1")
    assert notify.wait_for("STATUS=engine ready")


async def _chat(client: httpx.AsyncClient, body: dict[str, object]) -> tuple[int, list[int], str | None]:
    """One chat request; for streams, the token ids received and the error event's message, if any."""
    if not body.get("stream"):
        resp = await client.post("/v1/chat/completions", json=body)
        return resp.status_code, [], None
    ids: list[int] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return resp.status_code, ids, chunk["error"]["message"]
            for choice in chunk.get("choices", []):
                ids += [
                    int(t["token"].removeprefix("token_id:"))
                    for t in (choice.get("logprobs") or {}).get("content") or []
                ]
        return resp.status_code, ids, None


@pytest.mark.lane
async def test_kill_engine_core_with_32_requests_in_flight(guarded: ServerProcess, model_name: str) -> None:
    import asyncio

    image = photo_uri("chelsea.png")
    deaths_before = metric(guarded, "vlguard_engine_deaths_total")
    old_core = engine_core(guarded)
    n_tokens = 512

    def body(i: int, stream: bool) -> dict[str, object]:
        messages = primary_messages(image) if i % 2 else [{"role": "user", "content": f"Safety report {i}."}]
        extra = {"logprobs": True, "return_tokens_as_token_ids": True} if stream else {}
        return {"model": model_name, "messages": messages, "max_tokens": n_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream, **extra}  # fmt: skip

    stop, seen = threading.Event(), []  # type: ignore[var-annotated]
    watcher = threading.Thread(target=ready_transitions, args=(guarded, stop, seen), daemon=True)
    watcher.start()
    limits = httpx.Limits(max_connections=64)
    try:
        async with httpx.AsyncClient(base_url=guarded.url, timeout=600, limits=limits) as client:
            tasks = [asyncio.create_task(_chat(client, body(i, stream=i >= 16))) for i in range(32)]
            deadline = time.monotonic() + 120
            while metric(guarded, "vlguard_requests_inflight") < 32:  # all 32 inside the engine
                assert time.monotonic() < deadline, "32 requests never were in the engine at once"
                await asyncio.sleep(0.1)
            old_core.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
        wait_until(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready again")
    finally:
        stop.set()
        watcher.join()

    plain, streams = results[:16], results[16:]
    assert [status for status, _, _ in plain] == [200] * 16
    for status, ids, error in streams:
        assert status == 200
        assert (error is None and len(ids) == n_tokens) or error is not None, (len(ids), error)
    assert seen[0] == 200 and 503 in seen and seen[-1] == 200 and REFUSED not in seen, seen
    assert metric(guarded, "vlguard_engine_deaths_total") == deaths_before + 1
    assert metric(guarded, "vlguard_engine_restarts_total") >= 1
    carried = metric(guarded, "vlguard_requests_replayed_total") + metric(guarded, "vlguard_requests_resumed_total")
    assert carried >= 32
    assert not old_core.is_running() or old_core.status() == psutil.STATUS_ZOMBIE
    assert engine_core(guarded).pid != old_core.pid  # exactly one engine core: no orphans


def test_interrupted_greedy_stream_is_token_identical(guarded: ServerProcess, model_name: str) -> None:
    # The stream must still be running when the engine is killed: 1024 tokens, and the engine core is looked
    # up before the stream starts (the lookup waits while an earlier test's core is reaped; in CI that wait
    # once outlasted a 256-token stream, so nothing was in flight at the kill).
    n_tokens = 1024
    messages = [{"role": "user", "content": "Describe every hazard on a building site in detail."}]
    reference, error = stream_tokens(guarded, model_name, messages, n_tokens)
    assert error is None and len(reference) == n_tokens
    deaths = metric(guarded, "vlguard_engine_deaths_total")
    resumed = metric(guarded, "vlguard_requests_resumed_total")
    core = engine_core(guarded)
    got_some = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream_tokens, guarded, model_name, messages, n_tokens, got_some, 8)
        assert got_some.wait(60)
        core.send_signal(signal.SIGKILL)
        ids, error = future.result()
    assert error is None
    assert ids == reference
    assert metric(guarded, "vlguard_engine_deaths_total") == deaths + 1
    assert metric(guarded, "vlguard_requests_resumed_total") == resumed + 1
    wait_until(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready again")


def test_stopped_engine_core_is_a_hang_and_recovers(guarded: ServerProcess, model_name: str) -> None:
    wait_until(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    hangs_before = metric(guarded, "vlguard_engine_deaths_total")
    core = engine_core(guarded)
    core.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    resp = client_for(guarded).chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Still there?"}], max_tokens=4
    )
    assert resp.choices[0].message is not None
    assert time.monotonic() - started < 300
    assert metric(guarded, "vlguard_engine_deaths_total") == hangs_before + 1
    text = httpx.get(guarded.url + "/metrics").text
    assert 'vlguard_engine_deaths_total{cause="hang"}' in text
    assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE


def test_poison_request_is_quarantined_while_other_traffic_succeeds(guarded: ServerProcess, model_name: str) -> None:
    client = client_for(guarded)
    wait_until(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    poison = [{"role": "user", "content": f"Please check{POISON_WORD} now."}]
    good = [{"role": "user", "content": "Is the door blocked?"}]
    with ThreadPoolExecutor(4) as pool:
        bad = pool.submit(
            client.chat.completions.with_raw_response.create, model=model_name, messages=poison, max_tokens=4
        )
        others = [pool.submit(client.chat.completions.create, model=model_name, messages=good, max_tokens=4)
                  for _ in range(6)]  # fmt: skip
        with pytest.raises(Exception) as refused:
            bad.result()
        assert all(f.result().choices for f in others)
    assert getattr(refused.value, "status_code", None) == 400
    assert "quarantined" in str(refused.value)
    # Never replayed again: a third try is refused at once, without another engine death.
    deaths = metric(guarded, "vlguard_engine_deaths_total")
    with pytest.raises(Exception, match="quarantined"):
        client.chat.completions.create(model=model_name, messages=poison, max_tokens=4)  # type: ignore[arg-type]
    assert metric(guarded, "vlguard_engine_deaths_total") == deaths
    assert metric(guarded, "vlguard_requests_quarantined_total") >= 2
    assert POISON_WORD.strip() not in guarded.log_path.read_text()  # logs carry the fingerprint only


def test_sigterm_stops_cleanly_with_stopping_notification(guarded: ServerProcess, notify: NotifySocket) -> None:
    tree = guarded.children()
    assert guarded.proc is not None
    guarded.proc.send_signal(signal.SIGTERM)
    # uvicorn re-raises the SIGTERM it drained on, so the status is "killed by SIGTERM": a clean stop for
    # systemd (SuccessExitStatus) and Docker alike. Failures exit 3 or 4.
    assert guarded.proc.wait(90) == -signal.SIGTERM
    notify.wait_for("STOPPING=1")
    _, alive = psutil.wait_procs(tree, timeout=30)
    # multiprocessing's resource tracker exits on its own once the last holder of its pipe is gone.
    assert not [p for p in alive if "resource_tracker" not in _cmdline(p)], alive


def test_restart_failures_beyond_budget_exit_non_zero(tiny_model: Path, tmp_path: Path) -> None:
    flag = tmp_path / "fail-engine-start"
    env = engine_env(VLGUARD_TEST_FAIL_START_IF=str(flag))
    argv = vlguard_argv(tiny_model, "--enforce-eager", "--guard-restart-max", "2", "--guard-restart-backoff", "0.1",
                        "--guard-watchdog-interval", "0.5")  # fmt: skip
    srv = ServerProcess(argv, tmp_path / "budget.log", env=env).start().wait_ready()
    try:
        flag.touch()  # from now on every engine start-up fails
        engine_core(srv).send_signal(signal.SIGKILL)
        assert srv.proc is not None
        status = srv.proc.wait(600)
        assert status == 4, srv.log_tail()
        assert "restart budget spent" in srv.log_path.read_text()
    finally:
        srv.stop()
        os.environ.pop("VLGUARD_TEST_FAIL_START_IF", None)
