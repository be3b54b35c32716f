"""#46 item 2: ``--api-server-count 2`` through the guard, on the real CPU engine (one server for the module).

An owner process launches the engine core; two API processes (``vlguard::api_0``, ``_1``) serve on one socket,
each with the door and the guarded client. The tests reach a chosen API process by holding a connection it
accepted (found through the process's own sockets), and check what the issue asks: requests on both, a SIGKILL
of the engine core under load carried over in both (every request 200, the stream token-identical, ``/ready``
back), a poison quarantined through one refused by the other, a client's fault budget spent through one spent in
both, and ``/metrics`` showing one engine.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import slow_steps_flag, token_ids
from tests.helpers import assert_session_ends, engine_core, labelled, metric, poll, process_name, sse_tokens
from tests.notify import NotifySocket
from tests.servers import SPARE, ServerProcess, engine_env, vlguard_argv

POISON_WORD = " Xylophonequartzmarker"  # its step raises in the worker (the fault plugin): a soft recovery
HANG_TIMEOUT_S = 5
KEYS = ("key-one", "key-two")  # two API keys: the presented key is the client (a loopback address is nobody)
FLAGS = (
    "--api-server-count", "2",
    "--enforce-eager",
    "--guard-watchdog-interval", "0.5",
    "--guard-hang-timeout", str(HANG_TIMEOUT_S),
    "--max-num-seqs", "4",  # four running requests at most: a fifth waits (the hang-clock test)
    "--guard-quarantine-deaths", "1",
    "--guard-client-fault-max", "2",
    "--api-key", *KEYS,
    *SPARE,  # the owner keeps the spare: the kill tests' rebuilds run in it
)  # fmt: skip


@pytest.fixture(scope="module")
def tier(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, notify: NotifySocket) -> Iterator[ServerProcess]:
    """Own launch, ended by SIGTERM in the module's last test; a systemd notify socket."""
    logs = tmp_path_factory.mktemp("logs")
    env = engine_env(
        VLGUARD_TEST_SLOW_STEPS_IF=str(logs / "slow-steps"),
        VLGUARD_TEST_POISON_TOKENS=",".join(map(str, token_ids(tiny_model, POISON_WORD))),
        NOTIFY_SOCKET=str(notify.path),
        WATCHDOG_USEC="2000000",
    )
    srv = ServerProcess(vlguard_argv(tiny_model, *FLAGS), logs / "tier.log", env=env)
    srv.start().wait_ready()
    yield srv
    srv.stop()


def api_processes(srv: ServerProcess) -> list[psutil.Process]:
    found = sorted((p for p in srv.children() if process_name(p).startswith("vlguard::api_")), key=process_name)
    assert [process_name(p) for p in found] == ["vlguard::api_0", "vlguard::api_1"]
    return found


def _accepted_by(procs: list[psutil.Process], client_port: int) -> psutil.Process | None:
    for proc in procs:
        if any(c.raddr and c.raddr.port == client_port for c in proc.net_connections(kind="tcp")):
            return proc
    return None


def pinned(srv: ServerProcess, key: str = KEYS[0], per_process: int = 1, tries: int = 80) -> list[list[httpx.Client]]:
    """``per_process`` one-connection clients for each API process, in index order: new connections until each
    process accepted that many (which process accepts one is the kernel's choice)."""
    procs = api_processes(srv)
    found: dict[int, list[httpx.Client]] = {p.pid: [] for p in procs}
    for _ in range(tries):
        client = httpx.Client(
            base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=120,
            limits=httpx.Limits(max_connections=1),
        )  # fmt: skip
        resp = client.get("/ready")
        port = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
        owner = _accepted_by(procs, port)
        if owner is not None and len(found[owner.pid]) < per_process:
            found[owner.pid].append(client)
        else:
            client.close()
        if all(len(clients) == per_process for clients in found.values()):
            return [found[p.pid] for p in procs]
    raise AssertionError(f"{tries} connections did not give {per_process} to each API process")


def close(*groups: list[httpx.Client]) -> None:
    for group in groups:
        for client in group:
            client.close()


def chat(client: httpx.Client, model: str, text: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return client.post("/v1/chat/completions", json=body)


def test_two_api_processes_each_serve(tier: ServerProcess, model_name: str) -> None:
    (first,), (second,) = pinned(tier)
    texts = [
        chat(c, model_name, "Is the exit clear?").json()["choices"][0]["message"]["content"] for c in (first, second)
    ]
    assert texts[0] == texts[1]  # one engine, greedy: the same answer through both
    close([first, second])


def test_systemd_hears_the_owner_once_both_are_ready(tier: ServerProcess, notify: NotifySocket) -> None:
    """Only the owner (the main process, NotifyAccess=main) notifies: READY=1 once both API processes are ready,
    then WATCHDOG=1 while both ping."""
    notify.wait_for("READY=1")
    assert sum(message == "READY=1" for message in notify.messages) == 1
    notify.wait_for("WATCHDOG=1")
    assert notify.wait_for("STATUS=engine ready")


def test_a_poison_quarantined_through_one_is_refused_by_the_other(tier: ServerProcess, model_name: str) -> None:
    (first,), (second,) = pinned(tier)
    deaths = metric(tier, "vlguard_engine_deaths_total")
    faulted = chat(second, model_name, f"Check{POISON_WORD} now")
    assert faulted.status_code in (400, 500, 503), faulted.text  # its own fault, absorbed in the step
    poll(lambda: metric(tier, "vlguard_engine_deaths_total") == deaths + 1, 30, "one engine fault counted")
    refused = chat(first, model_name, f"Check{POISON_WORD} now")
    assert refused.status_code == 400 and "quarantined" in refused.json()["error"]["message"], refused.text
    assert metric(tier, "vlguard_engine_deaths_total") == deaths + 1  # never reached the engine again
    close([first, second])


def test_a_fault_budget_spent_through_one_is_spent_in_both(tier: ServerProcess, model_name: str) -> None:
    (first,), (second,) = pinned(tier, key=KEYS[1])
    for n in range(2):  # --guard-client-fault-max 2: two faults of this client's own (new fingerprints)
        chat(first, model_name, f"Variant {n}{POISON_WORD}")
    poll(lambda: chat(first, model_name, "Is the exit clear?").status_code == 429, 30, "the client refused")
    # The other process learns of the faults through the owner, not on the request path (docs/architecture.md:
    # taken in at its next read): a request sent to it at once can still pass (one did in a full-suite run).
    poll(lambda: chat(second, model_name, "Is the exit clear?").status_code == 429, 10, "refused by the other too")
    refused = chat(second, model_name, "Is the exit clear?")
    assert refused.status_code == 429 and "retry-after" in refused.headers, refused.text
    others = [c for group in pinned(tier, key=KEYS[0]) for c in group]  # another client: served through both
    assert [chat(c, model_name, "Is the exit clear?").status_code for c in others] == [200, 200]
    close([first, second], others)


Ended = tuple[list[int], str | None]  # a stream's token ids, and its error message or None


def _stream(client: httpx.Client, model: str, n: int, started: threading.Event) -> Ended:
    body = {"model": model, "messages": [{"role": "user", "content": "Describe every hazard on a site."}],
            "max_tokens": n, "temperature": 0, "stream": True, "logprobs": True, "ignore_eos": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = []
        for line in resp.iter_lines():
            lines.append(line)
            if len(sse_tokens(lines)[0]) >= 8:
                started.set()
    return sse_tokens(lines)


def _killed_during(
    srv: ServerProcess, jobs: list[tuple[httpx.Client, int]], model: str
) -> list[tuple[list[int], str | None]]:
    """Run one greedy stream of ``n`` tokens per ``(client, n)`` at once, SIGKILL the engine core once each has 8
    tokens, and return how each stream ended (every step 25 ms slower until the kill: all are still decoding)."""
    core = engine_core(srv)
    flag = slow_steps_flag(srv)
    flag.touch()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            events = [threading.Event() for _ in jobs]
            streams = [pool.submit(_stream, c, model, n, e) for (c, n), e in zip(jobs, events, strict=True)]
            assert all(e.wait(60) for e in events)
            core.send_signal(signal.SIGKILL)
            flag.unlink()
            return [s.result() for s in streams]
    finally:
        flag.unlink(missing_ok=True)


def test_a_request_waiting_behind_another_processs_requests_is_not_a_hang(tier: ServerProcess, model_name: str) -> None:
    """API process 0's four streams hold every running slot; API process 1's request waits longer than the hang
    timeout with no output of its own. The engine core stepped all along: no death (before: API process 1 saw
    no step output for its own client and killed the engine core as hung)."""
    firsts, (second,) = pinned(tier, per_process=4)[0], pinned(tier)[1]
    deaths = metric(tier, "vlguard_engine_deaths_total")
    flag = slow_steps_flag(tier)
    flag.touch()  # 25 ms more a step: 400 tokens take 10 s at least
    try:
        with ThreadPoolExecutor(4) as pool:
            events = [threading.Event() for _ in range(4)]
            streams = [pool.submit(_stream, c, model_name, 400, e) for c, e in zip(firsts, events, strict=True)]
            assert all(e.wait(60) for e in events)
            started = time.monotonic()
            waited = chat(second, model_name, "Is the exit clear?")
            elapsed = time.monotonic() - started
            assert all(s.result()[1] is None for s in streams)
    finally:
        flag.unlink(missing_ok=True)
    assert waited.status_code == 200, waited.text
    assert elapsed > HANG_TIMEOUT_S + 0.5, f"waited {elapsed:.1f} s: not past the hang timeout, the test shows nothing"
    assert metric(tier, "vlguard_engine_deaths_total") == deaths
    close(firsts, [second])


def test_a_stream_is_resumed_token_identical_through_an_api_process(tier: ServerProcess, model_name: str) -> None:
    """Alone in the engine (as its reference ran: co-batched requests change a CPU engine's greedy answers),
    a stream through API process 1 outlives a SIGKILL of the engine core token for token."""
    (first,), (second,) = pinned(tier)
    reference = _stream(second, model_name, 256, threading.Event())
    assert reference[1] is None and len(reference[0]) == 256
    poll(lambda: metric(tier, "vlguard_engine_spare_up") == 1, 120, "the owner's spare to be ready")
    handed = len(re.findall(r"(EngineCore|VllmWorker-0) runs in spare process", tier.log_path.read_text()))
    assert _killed_during(tier, [(second, 256)], model_name) == [reference]
    assert [c.get("/ready").status_code for c in (first, second)] == [200, 200]  # each API process READY again
    close([first, second])
    # the owner rebuilt through its spare: engine core and worker (a refused worker spare cost 21.5 s, not ~5)
    assert len(re.findall(r"(EngineCore|VllmWorker-0) runs in spare process", tier.log_path.read_text())) == handed + 2


def test_sigkill_under_load_is_carried_over_in_both(tier: ServerProcess, model_name: str) -> None:
    firsts, seconds = pinned(tier, per_process=2)
    deaths = labelled(tier, "vlguard_engine_deaths_total", "cause")
    resumed = len(re.findall(r"carried over: resume", tier.log_path.read_text(errors="replace")))
    ended = _killed_during(tier, [(c, 128) for c in (*firsts, *seconds)], model_name)
    assert [(len(ids), error) for ids, error in ended] == [(128, None)] * 4  # every stream whole, no error
    assert [c.get("/ready").status_code for c in (*firsts, *seconds)] == [200] * 4
    close(firsts, seconds)
    log = tier.log_path.read_text(errors="replace")
    assert len(re.findall(r"carried over: resume", log)) >= resumed + 4
    restarted = re.findall(r"\[vlguard api (\d) server\.guard\.supervisor\] engine restarted", log)
    assert restarted[-2:] in (["0", "1"], ["1", "0"])  # the last rebuild: both API processes back on it
    after = labelled(tier, "vlguard_engine_deaths_total", "cause")
    assert after["process_exit"] == deaths["process_exit"] + 1  # one engine: one death, not one per API process
    assert metric(tier, "vlguard_engine_up") == 1


def test_sigterm_drains_both_and_ends_every_process(tier: ServerProcess, model_name: str, notify: NotifySocket) -> None:
    """SIGTERM to the owner: each API process drains its stream, then the engine ends; exit by SIGTERM (143),
    STOPPING=1, and nothing of the server left."""
    assert tier.proc is not None
    firsts, seconds = pinned(tier)
    flag = slow_steps_flag(tier)
    flag.touch()  # 128 tokens take 3.2 s at least: both streams are in flight at the SIGTERM
    try:
        with ThreadPoolExecutor(2) as pool:
            events = [threading.Event(), threading.Event()]
            streams = [
                pool.submit(_stream, c, model_name, 128, e) for c, e in zip((*firsts, *seconds), events, strict=True)
            ]
            assert all(e.wait(60) for e in events)
            tier.proc.send_signal(signal.SIGTERM)
            ended = [s.result() for s in streams]
    finally:
        flag.unlink(missing_ok=True)
    assert [(len(ids), error) for ids, error in ended] == [(128, None)] * 2
    assert tier.proc.wait(90) == -signal.SIGTERM
    notify.wait_for("STOPPING=1")
    assert_session_ends(tier.proc.pid)
