"""The engine guard under real faults on the real CPU engine (CASES C6; C5 in test_recovery.py, C7 in
test_lifecycle.py).

Faults: SIGKILL and SIGSTOP of the real ``VLLM::EngineCore`` process, a test plugin that makes the real
model runner raise on a marker prompt, and one that makes engine start-up fail. Every wait is a
readiness or metrics poll with a deadline.
"""

from __future__ import annotations

import json
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from server.workload.images import data_uri, photo_uri
from server.workload.twopass import primary_messages
from tests.conftest import slow_steps_flag, token_ids
from tests.helpers import (
    assert_session_ends,
    carried_over,
    engine_core,
    gone,
    labelled,
    metric,
    poll,
    process_name,
    sse_tokens,
)
from tests.notify import NotifySocket
from tests.servers import ServerProcess, engine_env, vlguard_argv

POISON_WORD = " Xylophonequartzmarker"  # its step raises in the worker (the model errors)
EXIT_WORD = " Zanzibarjunipermarker"  # its worker process exits in the middle of the step (a crash)
DEVICE_WORD = " Quagmireobsidianmarker"  # its step raises what reads as a CUDA error (a poisoned device)
CORE_WORD = " Vermilionkumquatmarker"  # the engine core raises processing its step's output
ADMIT_WORD = " Quokkatambourinemarker"  # the scheduler raises admitting it (inside schedule(), not a step)
OUTPUT_WORD = " Wombatcardamommarker"  # the scheduler raises processing its own new tokens
DETOKENIZE_WORD = " Narwhalsaffronmarker"  # the API process raises turning its tokens into a response
WORDS = (POISON_WORD, EXIT_WORD, DEVICE_WORD, CORE_WORD, ADMIT_WORD, OUTPUT_WORD, DETOKENIZE_WORD)
BODY_BUDGET_MB = 64  # request bodies the API process may hold at once (the burst test)
GUARD_FLAGS = (
    "--enforce-eager",
    "--guard-hang-timeout", "10",
    "--guard-watchdog-interval", "0.5",
    "--guard-ready-probe-interval", "2",
    "--guard-quarantine-deaths", "2",
    "--guard-restart-max", "20",
    "--guard-hold-timeout", "300",  # a cold rebuild beside CI's other half took over the 120 s default
    "--guard-client-fault-max", "0",  # every test here is the same loopback client: no cool-down between them
    "--guard-max-body-memory-mb", str(BODY_BUDGET_MB),
)  # fmt: skip


@pytest.fixture(scope="module")
def poison_ids(tiny_model: Path) -> dict[str, list[int]]:
    return {word: token_ids(tiny_model, word) for word in WORDS}


@pytest.fixture(scope="module")
def guarded(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, poison_ids: dict[str, list[int]], notify: NotifySocket
) -> Iterator[ServerProcess]:
    """Own launch: its engine is killed, stopped and poisoned, and it ends with SIGTERM (the module's
    last test); short guard timeouts and a systemd notify socket."""
    logs = tmp_path_factory.mktemp("logs")
    env = engine_env(
        VLGUARD_TEST_SLOW_STEPS_IF=str(logs / "slow-steps"),
        VLGUARD_TEST_POISON_TOKENS=",".join(map(str, poison_ids[POISON_WORD])),
        VLGUARD_TEST_POISON_EXIT_TOKENS=",".join(map(str, poison_ids[EXIT_WORD])),
        VLGUARD_TEST_POISON_DEVICE_TOKENS=",".join(map(str, poison_ids[DEVICE_WORD])),
        VLGUARD_TEST_POISON_DEVICE_ONCE=str(tmp_path_factory.mktemp("flags") / "device-fault-happened"),
        VLGUARD_TEST_POISON_CORE_TOKENS=",".join(map(str, poison_ids[CORE_WORD])),
        VLGUARD_TEST_POISON_ADMIT_TOKENS=",".join(map(str, poison_ids[ADMIT_WORD])),
        VLGUARD_TEST_POISON_OUTPUT_TOKENS=",".join(map(str, poison_ids[OUTPUT_WORD])),
        VLGUARD_TEST_POISON_DETOKENIZE_TOKENS=",".join(map(str, poison_ids[DETOKENIZE_WORD])),
        NOTIFY_SOCKET=str(notify.path),
        WATCHDOG_USEC="2000000",
    )
    srv = ServerProcess(vlguard_argv(tiny_model, *GUARD_FLAGS), logs / "guard.log", env=env)
    srv.start().wait_ready()
    srv.initial_metrics = httpx.get(srv.url + "/metrics").text  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def client_for(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def stream_tokens(srv: ServerProcess, model: str, messages: list[dict[str, object]], max_tokens: int,
                  on_token: threading.Event | None = None, after: int = 1) -> tuple[list[int], str | None]:  # fmt: skip
    """Greedy stream with token ids; returns ``(token_ids, error_message_or_None)``. ``on_token`` is set
    once ``after`` tokens arrived."""
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "logprobs": True, "ignore_eos": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        lines, count = [], 0
        for line in resp.iter_lines():
            lines.append(line)
            count += len(sse_tokens([line])[0])
            if on_token is not None and count >= after:
                on_token.set()
    return sse_tokens(lines)


def recoveries(srv: ServerProcess) -> dict[str, float]:
    return labelled(srv, "vlguard_engine_recoveries_total", "kind")


def test_fault_counters_start_at_zero(guarded: ServerProcess) -> None:
    """#15: every labelled fault counter is exported at 0 before the first fault (read when the server
    became ready), so the alert rules' increase() sees the first one."""
    text = guarded.initial_metrics  # type: ignore[attr-defined]
    assert labelled(guarded, "vlguard_engine_deaths_total", "cause", text) == dict.fromkeys(
        ("deepstack", "process_exit", "hang", "exception"), 0.0
    )
    assert labelled(guarded, "vlguard_engine_recoveries_total", "kind", text) == {"soft": 0.0, "rebuild": 0.0}
    assert labelled(guarded, "vlguard_engine_restarts_total", "outcome", text) == {"success": 0.0, "failure": 0.0}
    assert labelled(guarded, "vlguard_engine_recovery_duration_seconds_count", "kind", text) == {
        "soft": 0.0,
        "rebuild": 0.0,
    }


def counter_samples(text: str) -> dict[str, float]:
    """Every counter and histogram sample in a ``/metrics`` text, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f"{s.name}{sorted(s.labels.items())}": s.value for f in text_string_to_metric_families(text)
            if f.type in ("counter", "histogram") for s in f.samples}  # fmt: skip


def client_series(text: str) -> dict[str, float]:
    """vLLM's client series in a ``/metrics`` text: every ``vllm:*`` counter and histogram sample (request
    counts, tokens, latencies); the engine's step and prefix-cache series aside (a probe's step is a step, and
    its one token is looked up in the prefix cache)."""
    engine_side = ("vllm:iteration_tokens", "vllm:prefix_cache_")
    return {k: v for k, v in counter_samples(text).items() if k.startswith("vllm:") and not k.startswith(engine_side)}


def test_probes_are_not_client_traffic(guarded: ServerProcess) -> None:
    """#63: vlguard's own probes (one at start-up, one per idle --guard-ready-probe-interval: 2 s here) move
    ``vlguard_engine_probes_total`` only, never vLLM's request, token or latency series (stock: 0 at idle)."""
    before = client_series(guarded.initial_metrics)  # type: ignore[attr-defined]
    assert before and all(v == 0 for k, v in before.items() if "request_success" in k), before
    probes = labelled(guarded, "vlguard_engine_probes_total", "result")
    assert probes.get("ok", 0) >= 1 and probes.get("failed") == 0  # the start-up's
    poll(lambda: labelled(guarded, "vlguard_engine_probes_total", "result")["ok"] >= probes["ok"] + 3, 30,
         "three idle probes")  # fmt: skip
    after = client_series(httpx.get(guarded.url + "/metrics").text)
    assert {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v} == {}


def test_systemd_ready_and_watchdog(guarded: ServerProcess, notify: NotifySocket) -> None:
    notify.wait_for("READY=1")
    notify.wait_for("WATCHDOG=1")
    assert notify.wait_for("STATUS=engine ready")


def test_a_long_non_streaming_request_is_not_a_hang(guarded: ServerProcess, model_name: str) -> None:
    # A non-streaming request yields nothing in the API process until it ends; the hang clock must follow
    # the engine core's steps, not request output (before: killed as a hang after --guard-hang-timeout 10).
    deaths = metric(guarded, "vlguard_engine_deaths_total")
    # Each step slowed by 25 ms (the fault plugin's flag): 480 tokens take at least 12 s on any machine
    # (4000 unslowed tokens took 13-18 s on earlier CI machines and 9.4 s on a faster one).
    flag = slow_steps_flag(guarded)
    flag.touch()
    try:
        started = time.monotonic()
        resp = client_for(guarded).chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Write the full site safety manual."}],
            max_tokens=480,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        elapsed = time.monotonic() - started
    finally:
        flag.unlink()
    assert resp.usage is not None and resp.usage.completion_tokens == 480
    # Silent for longer than the hang timeout plus one watchdog interval (10 + 0.5 s), or it shows nothing.
    assert elapsed > 10.5, f"took {elapsed:.1f} s: not longer than the hang timeout, the test shows nothing"
    assert metric(guarded, "vlguard_engine_deaths_total") == deaths


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
    # Each step 25 ms slower until the kill (the fault plugin's flag): the stream is still decoding when it
    # lands however far its reader lags (in CI the engine once finished all 1024 tokens before the reader
    # had 8, so nothing was in flight to resume).
    flag = slow_steps_flag(guarded)
    flag.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream_tokens, guarded, model_name, messages, n_tokens, got_some, 8)
            assert got_some.wait(60)
            core.send_signal(signal.SIGKILL)
            flag.unlink()
            ids, error = future.result()
    finally:
        flag.unlink(missing_ok=True)
    assert error is None
    assert ids == reference
    # Read until counted (bounded): under CI load this read once saw 0 deaths after the resumed stream ended.
    poll(lambda: metric(guarded, "vlguard_engine_deaths_total") == deaths + 1, 30, "the death counted")
    assert metric(guarded, "vlguard_requests_resumed_total") == resumed + 1
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready again")


def test_stopped_engine_core_is_a_hang_and_recovers(guarded: ServerProcess, model_name: str) -> None:
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
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
    assert gone(core)


@pytest.mark.parametrize(
    ("word", "kind"),
    [(POISON_WORD, "soft"), (EXIT_WORD, "rebuild")],
    ids=["raises", "kills-its-worker"],
)
def test_poison_request_is_quarantined_while_other_traffic_succeeds(
    guarded: ServerProcess, model_name: str, word: str, kind: str
) -> None:
    """CASES C6 / #20 / #15: the request whose step fails is charged; after two such faults it is refused
    with 400 and never replayed; the innocent requests sharing the engine meanwhile all succeed. A model
    exception is absorbed softly (no rebuild); a worker that died escalates to rebuilds."""
    client = client_for(guarded)
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    quarantined = metric(guarded, "vlguard_quarantine_fingerprints")
    before = recoveries(guarded)
    poison = [{"role": "user", "content": f"Please check{word} now."}]
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
    assert metric(guarded, "vlguard_quarantine_fingerprints") == quarantined + 1  # the poison alone
    after = recoveries(guarded)
    other = "rebuild" if kind == "soft" else "soft"
    assert (after[kind] - before[kind], after[other] - before[other]) == (2, 0)
    # Never replayed again: a third try is refused at once, without another engine fault.
    deaths = metric(guarded, "vlguard_engine_deaths_total")
    with pytest.raises(Exception, match="quarantined"):
        client.chat.completions.create(model=model_name, messages=poison, max_tokens=4)  # type: ignore[arg-type]
    assert metric(guarded, "vlguard_engine_deaths_total") == deaths
    assert metric(guarded, "vlguard_requests_quarantined_total") >= 2
    assert word.strip() not in guarded.log_path.read_text()  # logs carry the fingerprint only


@pytest.mark.parametrize(
    "word",
    [ADMIT_WORD, OUTPUT_WORD, DETOKENIZE_WORD],
    ids=["while-admitting", "processing-its-output", "detokenizing-in-the-api-process"],
)
def test_a_fault_outside_the_model_step_is_charged_to_its_request(
    guarded: ServerProcess, model_name: str, word: str
) -> None:
    """#33: the engine core raises while its scheduler admits the poison (inside ``schedule()``, before
    any model step: charged to nobody before, so every fault of it cut everything and ended in a rebuild
    and a 503), or while it processes the poison's own tokens after a step shared with others; or the API
    process's output processor raises on the poison's tokens (before: the output handler died, every
    request failed, the engine was rebuilt). The failing code names its request: the poison alone is
    charged, quarantined after two faults with a 400, no rebuild, and every innocent in flight is served."""
    client = client_for(guarded)
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    before, named = recoveries(guarded), labelled(guarded, "vlguard_quarantine_strikes_total", "evidence")["named"]
    poison = [{"role": "user", "content": f"Please check{word} now."}]
    good = [[{"role": "user", "content": f"Is ladder {i} secured?"}] for i in range(6)]
    with ThreadPoolExecutor(7) as pool:
        others = [pool.submit(client.chat.completions.create, model=model_name, messages=m, max_tokens=16,
                              temperature=0, extra_body={"ignore_eos": True}) for m in good]  # fmt: skip
        bad = pool.submit(client.chat.completions.with_raw_response.create, model=model_name, messages=poison,
                          max_tokens=4)  # fmt: skip
        with pytest.raises(Exception) as refused:
            bad.result()
        assert [len(f.result().choices) for f in others] == [1] * 6
    assert getattr(refused.value, "status_code", None) == 400 and "quarantined" in str(refused.value)
    after = recoveries(guarded)
    assert (after["soft"] - before["soft"], after["rebuild"] - before["rebuild"]) == (2, 0)
    assert labelled(guarded, "vlguard_quarantine_strikes_total", "evidence")["named"] == named + 2


def test_a_device_error_rebuilds_and_the_request_is_served(guarded: ServerProcess, model_name: str) -> None:
    """#15: an exception that reads as a poisoned CUDA context is not absorbed: the engine is rebuilt, and
    the request (a transient fault: once) is replayed on the new engine and served, as are its neighbours."""
    client = client_for(guarded)
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    before = recoveries(guarded)
    faulty = [{"role": "user", "content": f"Please check{DEVICE_WORD} now."}]
    # Neighbours of their own: a request charged in an earlier test's failing step has a strike already.
    good = [[{"role": "user", "content": f"Is stairwell {i} clear?"}] for i in range(3)]
    with ThreadPoolExecutor(4) as pool:
        results = [pool.submit(client.chat.completions.create, model=model_name, messages=m, max_tokens=4)
                   for m in (faulty, *good)]  # fmt: skip
        assert all(f.result().choices for f in results)
    after = recoveries(guarded)
    assert (after["rebuild"] - before["rebuild"], after["soft"] - before["soft"]) == (1, 0)
    assert "not absorbed: device error" in guarded.log_path.read_text()


def test_no_block_of_a_failed_step_is_served_again(guarded: ServerProcess, model_name: str) -> None:
    """#15: the poison's prefill step raises before the model writes its KV blocks, but the scheduler had
    already put those blocks (a long prefix shared with the next request) in the prefix cache. After the
    soft recovery the request sharing that prefix must be computed afresh: its greedy answer equals the
    one computed with a cache salt (no shared block possible)."""
    client = client_for(guarded)
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    shared = " ".join(f"Checkpoint {i} on the north stairwell is clear." for i in range(30))  # ~300 tokens
    poison = [{"role": "user", "content": f"{shared}{POISON_WORD} now."}]
    probe = [{"role": "user", "content": f"{shared} Anything else?"}]

    def answer(**extra: object) -> list[int]:
        body = {"return_tokens_as_token_ids": True, **extra}
        resp = client.chat.completions.create(
            model=model_name,
            messages=probe,
            max_tokens=24,
            temperature=0,
            logprobs=True,
            extra_body=body,  # type: ignore[arg-type]
        )
        assert resp.choices[0].logprobs is not None and resp.choices[0].logprobs.content is not None
        return [int(t.token.split(":")[1]) for t in resp.choices[0].logprobs.content]

    before = recoveries(guarded)
    with pytest.raises(Exception, match="quarantined"):
        client.chat.completions.create(model=model_name, messages=poison, max_tokens=4)  # type: ignore[arg-type]
    assert recoveries(guarded)["soft"] == before["soft"] + 2
    assert answer() == answer(cache_salt=f"fresh-{time.monotonic_ns()}")


def test_engine_core_fault_is_absorbed_under_a_live_stream(guarded: ServerProcess, model_name: str) -> None:
    """#15: the engine core itself raises (processing a step's output) while a greedy stream is running:
    recovered softly, no rebuild; the stream goes on token-identical to an uninterrupted run; the faulting
    request is quarantined after two faults; afterwards no KV block is held when idle and /ready is 200."""
    client = client_for(guarded)
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    messages = [{"role": "user", "content": "List the checks before entering a confined space."}]
    n_tokens = 1000
    reference, error = stream_tokens(guarded, model_name, messages, n_tokens)
    assert error is None and len(reference) == n_tokens
    before, resumed = recoveries(guarded), metric(guarded, "vlguard_requests_resumed_total")
    got_some = threading.Event()
    poison = [{"role": "user", "content": f"Please check{CORE_WORD} now."}]
    # Every step 25 ms slower until the poison is answered: the stream (>= 25 s of steps) is still decoding
    # at both of its faults however fast the machine (3 s of decoding once finished first in CI).
    slow = Path(guarded.env["VLGUARD_TEST_SLOW_STEPS_IF"])
    slow.touch()
    try:
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(stream_tokens, guarded, model_name, messages, n_tokens, got_some, 8)
            assert got_some.wait(60)
            with pytest.raises(Exception, match="quarantined"):
                client.chat.completions.create(model=model_name, messages=poison, max_tokens=4)  # type: ignore[arg-type]
            slow.unlink()
            ids, error = stream.result()
    finally:
        slow.unlink(missing_ok=True)
    assert error is None
    assert ids == reference
    after = recoveries(guarded)
    assert (after["soft"] - before["soft"], after["rebuild"] - before["rebuild"]) == (2, 0)
    assert metric(guarded, "vlguard_requests_resumed_total") >= resumed + 1
    poll(lambda: metric(guarded, "vllm:kv_cache_usage_perc") == 0, 30, "KV cache usage back to 0")
    assert httpx.get(guarded.url + "/ready").status_code == 200


def test_identical_requests_at_repeated_external_kills_are_never_quarantined(
    guarded: ServerProcess, model_name: str
) -> None:
    """#20: the same image and prompt recur (a fixed camera, a retrying client) while the engine core is
    SIGKILLed from outside twice, as many deaths as quarantine a request that was in flight at them
    (``quarantine_deaths``): a kill is no evidence against what was in flight, so every request is served
    and nothing is quarantined (before the fix, the second kill's replays were refused with 400; the
    unit test ``test_external_kills_charge_nobody`` covers the counting). Six kills cost 3.5 minutes of CI
    and showed nothing more."""
    client = client_for(guarded)
    messages = primary_messages(photo_uri("coffee.png"))
    strikes = metric(guarded, "vlguard_quarantine_strikes_total")
    refused = metric(guarded, "vlguard_requests_quarantined_total")
    for _ in range(2):
        poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
        core, carried = engine_core(guarded), carried_over(guarded)  # read before the requests are sent
        # Two non-streaming requests first, then two identical streams, killed once both streams have tokens.
        # The steps are slow (25 ms more each) until the kill: 512 tokens then take over 12 s, not ~2.5 s, so
        # the kill finds them in flight however far the streams' first tokens lag behind the engine (a CI
        # run's second kill found all four finished: 0 in flight). (Waiting on the in-flight gauge instead
        # raced: identical requests served from the prefix cache finished between the poll and the kill.)
        started, slow = [threading.Event(), threading.Event()], slow_steps_flag(guarded)
        slow.touch()
        with ThreadPoolExecutor(4) as pool:
            try:
                plain = [pool.submit(client.chat.completions.create, model=model_name, messages=messages,
                                     max_tokens=512, temperature=0, extra_body={"ignore_eos": True})
                         for _ in range(2)]  # fmt: skip
                streams = [pool.submit(stream_tokens, guarded, model_name, messages, 512, ev) for ev in started]
                assert all(ev.wait(120) for ev in started), "the streams never started"
                core.send_signal(signal.SIGKILL)
            finally:
                slow.unlink(missing_ok=True)
            assert [len(f.result().choices) for f in plain] == [1, 1]  # served: 200
            assert [(len(ids), err) for ids, err in (f.result() for f in streams)] == [(512, None), (512, None)]
        # requests of the one fingerprint were in flight at each kill (they carry its strikes, if any): at
        # least one each time, which is what would quarantine it (the second stream may not have started
        # before the first finished: CI once carried one, 38 -> 39)
        assert carried_over(guarded) >= carried + 1
    assert metric(guarded, "vlguard_quarantine_strikes_total") == strikes
    assert metric(guarded, "vlguard_requests_quarantined_total") == refused


def test_the_metrics_folder_keeps_live_processes_and_one_archive(guarded: ServerProcess) -> None:
    """#63: after the rebuilds of this module (kills, a hang, a device error) and one more here, the metrics
    folder holds files of live processes only, plus one archive per kind; every counter sample read before
    the last rebuild is still there, none lower."""

    def counters() -> dict[str, float]:
        return counter_samples(httpx.get(guarded.url + "/metrics").text)

    assert guarded.proc is not None
    (folder,) = Path(tempfile.gettempdir()).glob(f"vlguard-metrics-{guarded.proc.pid}.*")
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    before, restarts = counters(), labelled(guarded, "vlguard_engine_restarts_total", "outcome")["success"]
    engine_core(guarded).kill()
    poll(lambda: labelled(guarded, "vlguard_engine_restarts_total", "outcome")["success"] > restarts, 300, "a rebuild")
    after = counters()
    assert {k: (v, after.get(k)) for k, v in before.items() if after.get(k, -1) < v} == {}
    assert restarts >= 4

    def dead_files() -> list[str]:
        httpx.get(guarded.url + "/metrics")  # each scrape folds what processes that are gone left
        pids = {int(m[1]) for f in folder.glob("*.db") if (m := re.match(r".*_(\d+)\.db$", f.name))}
        assert pids
        return [f"{pid}: {psutil.Process(pid).status()}" if psutil.pid_exists(pid) else str(pid) for pid in pids
                if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE]  # fmt: skip

    poll(lambda: not dead_files(), 60, "only live processes' files (the killed worker may take seconds to die)")
    assert {f.name for f in folder.glob("*_archive.db")} >= {"counter_archive.db", "histogram_archive.db"}


def padded_png(size: int) -> bytes:
    """A 32x32 PNG of about ``size`` bytes: the padding is a private ancillary chunk, which decoders skip."""
    import io
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (90, 120, 30)).save(buf, "PNG")
    png, data = buf.getvalue(), b"\0" * size
    chunk = struct.pack(">I", len(data)) + b"vgPd" + data + struct.pack(">I", zlib.crc32(b"vgPd" + data))
    return png[:33] + chunk + png[33:]  # after the signature and IHDR


def test_a_burst_of_large_bodies_during_a_rebuild_is_bounded_by_bytes(guarded: ServerProcess, model_name: str) -> None:
    """#33 (CASES C19): 40 requests of 8 MiB each arrive while the engine is being rebuilt. Before, every
    body was held (bounded by count only: 512 of up to 64 MiB): 60 of 20 MiB grew the API process by 4.4
    GiB. Now the bodies held at once are bounded by --guard-max-body-memory-mb (64 here): each request is
    answered 200 (held, then served) or 503 + Retry-After at once, and the API process grows by at most
    what the budget's bodies cost and a fixed margin (an image body costs about four times its bytes while
    it is parsed and decoded: --guard-max-body-memory-mb's own rule; 371 MiB measured)."""
    assert guarded.proc is not None
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 200, 300, "ready")
    api = psutil.Process(guarded.proc.pid)
    # 8 MiB of image (a small picture with a private chunk: decoding skips it); a field vLLM ignores (the
    # ``user`` string this test used) holds at most 64 KiB of text now (#61)
    image = data_uri(padded_png(8 << 20), "image/png")
    content = [{"type": "text", "text": "Is the exit clear?"}, {"type": "image_url", "image_url": {"url": image}}]
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 2}).encode()  # fmt: skip
    before = api.memory_info().rss
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], api.memory_info().rss)

    def send(_: int) -> tuple[int, str | None]:
        resp = httpx.post(guarded.url + "/v1/chat/completions", content=body, timeout=300,
                          headers={"content-type": "application/json"})  # fmt: skip
        return resp.status_code, resp.headers.get("retry-after")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    engine_core(guarded).send_signal(signal.SIGKILL)
    poll(lambda: httpx.get(guarded.url + "/ready").status_code == 503, 30, "the engine to be down")
    try:
        with ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(send, range(40)))
    finally:
        done.set()
        watcher.join()
    codes = sorted(code for code, _ in answers)
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    assert all(retry for code, retry in answers if code == 503)
    growth_mb = (peak[0] - before) / 2**20
    print(f"API process grew {growth_mb:.0f} MiB for {codes.count(200)} held and {codes.count(503)} refused bodies")
    assert growth_mb < 4 * BODY_BUDGET_MB + 192, f"grew {growth_mb:.0f} MiB with a {BODY_BUDGET_MB} MiB budget"
    assert metric(guarded, "vlguard_request_body_bytes") == 0


def test_sigterm_during_a_rebuild_stops_cleanly(guarded: ServerProcess, notify: NotifySocket) -> None:
    """The engine core is killed and, while its replacement is being spawned, vlguard gets SIGTERM (#21):
    exit "killed by SIGTERM" (143, uvicorn re-raises the signal it drained on: a clean stop for systemd and
    Docker; failures exit 3 or 4), STOPPING=1, and nothing of the server left 10 s later."""
    assert guarded.proc is not None
    old = engine_core(guarded)
    old.kill()
    poll(lambda: [p for p in guarded.children() if "EngineCore" in process_name(p) and p.pid != old.pid], 120,
         "the replacement engine core to be spawned")  # fmt: skip
    guarded.proc.send_signal(signal.SIGTERM)
    assert guarded.proc.wait(90) == -signal.SIGTERM
    notify.wait_for("STOPPING=1")
    assert_session_ends(guarded.proc.pid)
