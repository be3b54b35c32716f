"""No vLLM process outlives vlguard, whatever way vlguard ends (real processes, CASES C7 too).

Each server starts in a session of its own (``start_new_session``) and vLLM's processes stay in it, so
"the processes of that server" are those of its session, whatever they are called (vLLM retitles them,
which also overwrites what ``/proc`` shows of their environment) and whoever their parent now is. A
process counts as left over when it still exists and is not a zombie.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from server import run_dirs
from server.workload.images import photo_uri
from server.workload.twopass import primary_messages, rescue_messages
from tests.helpers import (
    assert_nothing_left,
    assert_session_ends,
    carried_over,
    engine_core,
    metric,
    poll,
    process_name,
    session_processes,
    spare_processes,
    sse_tokens,
)
from tests.servers import NO_COMPILE_WHEN_EAGER, REPO, SPARE, ServerProcess, engine_env, free_port, vlguard_argv

EAGER = ("--enforce-eager", "--guard-watchdog-interval", "0.5")


@pytest.fixture
def sessions() -> Iterator[list[int]]:
    """Sessions of the servers a test started; whatever of them is still alive after the test is killed."""
    started: list[int] = []
    yield started
    for sid in started:
        for proc in session_processes(sid):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _start(sessions: list[int], tiny_model: Path, log: Path, *flags: str, **env: str) -> ServerProcess:
    srv = ServerProcess(vlguard_argv(tiny_model, *EAGER, *flags), log, env=engine_env(**env)).start()
    assert srv.proc is not None
    sessions.append(srv.proc.pid)
    return srv


@pytest.fixture(scope="module")
def fresh_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with spares, as shipped, READY a moment ago: the module's first test runs seconds after its
    first /ready (the window #49 is about); the SIGKILL test then ends it. One start for both."""
    sessions: list[int] = []
    restarts = ("--guard-restart-max", "20")  # VLGUARD_TEST_KILL_PAIRS=5 kills it 10 times
    srv = _start(sessions, tiny_model, tmp_path_factory.mktemp("fresh") / "server.log", *SPARE, *restarts)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        for proc in session_processes(sessions[0]):
            with contextlib.suppress(psutil.Error):
                proc.kill()


async def test_two_deaths_seconds_after_ready_lose_nothing(fresh_server: ServerProcess, model_name: str) -> None:
    """#49: the engine core SIGKILLed 2 s after the server's first /ready, under 12 clients sending two-pass
    requests (half streaming, greedy: resumable), then again 2 s after the rebuilt engine's /ready (each kill
    at the first token after those 2 s of a stream with more to come: on a busy machine the requests may
    all still be in the API process's rendering 2 s after /ready, and a kill then carries none over): /ready
    comes back each time, every request 200, every stream whole (no error event), nothing held times out,
    and neither rebuild starts cold: each uses the spare still importing (on 2 CPUs it is spawned once the
    engine is READY; from 4, beside the engine's start, then ready at the first /ready). ``VLGUARD_TEST_KILL_PAIRS``
    repeats the pair (CI runs one; 5 to hunt the rare hang of the issue)."""
    srv, pairs = fresh_server, int(os.environ.get("VLGUARD_TEST_KILL_PAIRS", "1"))
    image, log_at, carried = photo_uri("chelsea.png"), srv.log_path.stat().st_size, carried_over(srv)
    stop, mid_stream, results = asyncio.Event(), asyncio.Event(), []

    async def client(http: httpx.AsyncClient, i: int) -> None:
        stream = {"stream": True, "logprobs": True, "return_tokens_as_token_ids": True} if i % 2 else {}
        while not stop.is_set():
            for messages in (primary_messages(image), rescue_messages(image)):
                body = {"model": model_name, "messages": messages, "max_tokens": 48, "temperature": 0, **stream}
                if not stream:
                    results.append(((await http.post("/v1/chat/completions", json=body)).status_code, None))
                    continue
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    lines: list[str] = []
                    chunks = 0
                    async for line in resp.aiter_lines():
                        lines.append(line)
                        chunks += line.startswith("data: {")
                        if 2 <= chunks <= 40:  # a token sent (after the role's chunk), 8+ still to come
                            mid_stream.set()
                    results.append((resp.status_code, sse_tokens(lines)[1]))

    def ready() -> bool:
        return httpx.get(srv.url + "/ready", timeout=10).status_code == 200

    async with httpx.AsyncClient(base_url=srv.url, timeout=600, limits=httpx.Limits(max_connections=32)) as http:
        clients = [asyncio.create_task(client(http, i)) for i in range(12)]
        try:
            for _ in range(2 * pairs):
                await asyncio.sleep(2)  # 2 s after /ready
                mid_stream.clear()
                await asyncio.wait_for(mid_stream.wait(), 120)
                engine_core(srv).kill()
                await asyncio.to_thread(poll, lambda: not ready(), 30, "the death noticed")
                await asyncio.to_thread(poll, ready, 300, "ready again")
        finally:
            stop.set()
            await asyncio.gather(*clients)
    failed = [r for r in results if r != (200, None)]
    assert results and not failed, failed[:5]
    assert carried_over(srv) > carried  # requests were in flight at the deaths, and carried over
    assert metric(srv, "vlguard_requests_failed_total") == 0  # nothing held timed out
    rebuilds = re.findall(r"engine restarted in [\d.]+ s \(generation \d+, (\w+)\)", srv.log_path.read_text()[log_at:])
    assert len(rebuilds) == 2 * pairs and "cold" not in rebuilds, rebuilds


def _while_building(srv: ServerProcess) -> None:
    """Wait until the first engine build has spawned its engine core (start-up in progress)."""
    poll(lambda: any("EngineCore" in process_name(p) for p in srv.children()), 120, "the engine core to be spawned")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_stop_during_first_startup(sessions: list[int], tiny_model: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM or SIGINT while the first engine loads does not wait for it (exit 143 / 130, "killed by" the
    signal) and leaves nothing in the temp folder (#63); SIGKILL leaves the engine processes to notice on
    their own, and its folders to the next start, which finds their owner gone."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    srv = _start(sessions, tiny_model, tmp_path / "server.log", TMPDIR=str(temp))
    _while_building(srv)
    assert srv.proc is not None and srv.proc.poll() is None
    signalled = time.monotonic()
    srv.proc.send_signal(sig)
    assert srv.proc.wait(60) == -sig, srv.log_tail()
    assert time.monotonic() - signalled < 20  # the engine build was abandoned, not waited for
    assert_session_ends(srv.proc.pid)
    if sig != signal.SIGKILL:
        assert_nothing_left(temp, srv.log_path)
    else:  # what vlguard serve's start does with them
        swept = run_dirs.sweep(str(temp))
        assert sorted(p.name.split("-")[1] for p in swept) == ["metrics", "state"], swept
        assert all(p.name.split("-")[2].startswith(f"{srv.proc.pid}.") for p in swept)


def test_sigkill_while_ready_with_requests_in_flight(fresh_server: ServerProcess, tiny_model: Path) -> None:
    """SIGKILL of vlguard with streams in flight (on the server the test above put through two deaths)."""
    import threading

    srv = fresh_server
    # The spare engine process and its worker spare (spawned once the spare has imported vLLM) must end too.
    poll(lambda: len(spare_processes(srv)) == 2, 120, "the spare and its worker spare")
    body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "Count."}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    streaming = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as resp:
                for _ in resp.iter_lines():
                    streaming.set()
        except httpx.HTTPError:
            pass  # the server is killed under it

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    assert srv.proc is not None
    srv.proc.kill()
    assert srv.proc.wait(30) == -signal.SIGKILL
    assert_session_ends(srv.proc.pid)


def test_a_stuck_rebuild_is_abandoned_and_sigkill_during_the_next_leaves_nothing(
    sessions: list[int], tiny_model: Path, tmp_path: Path
) -> None:
    """#49: the engine core is killed; the replacement (the spare, handed over) is stopped (SIGSTOP) before it
    is ready: the rebuild is abandoned at ``--guard-rebuild-timeout`` (the processes it started killed, the
    stopped one included) and the attempt fails; as the next one starts, vlguard is SIGKILLed, and every
    process of the server ends with it. (SIGTERM during a rebuild:
    test_guard.py's last test.)"""
    # 10 s: the replacement is the spare, imported beforehand (a healthy hand-over takes ~5 s here)
    srv = _start(sessions, tiny_model, tmp_path / "server.log", *SPARE, "--guard-rebuild-timeout", "10")
    srv.wait_ready()
    old = engine_core(srv)

    def new_core(*not_these: int) -> list[psutil.Process]:
        return [p for p in srv.children() if "EngineCore" in process_name(p) and p.pid not in not_these]

    old.kill()
    (stuck,) = poll(lambda: new_core(old.pid), 120, "the replacement engine core to be spawned")
    stuck.send_signal(signal.SIGSTOP)
    poll(lambda: "abandoning it" in srv.log_path.read_text(), 60, "the stuck rebuild abandoned")
    # The attempt failed once its processes were killed (the next one starts after the back-off: unit-tested)
    poll(lambda: "engine restart attempt failed (1)" in srv.log_path.read_text(), 60, "the attempt to fail")
    poll(lambda: not stuck.is_running() or stuck.status() == psutil.STATUS_ZOMBIE, 30, "the stopped core killed")
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGKILL)
    assert srv.proc.wait(90) == -signal.SIGKILL, srv.log_tail()
    assert_session_ends(srv.proc.pid)


def test_restart_failures_beyond_budget_exit_non_zero(sessions: list[int], tiny_model: Path, tmp_path: Path) -> None:
    """CASES C7: restarting keeps failing -> exit status 4 (never 0), and nothing is left behind. One
    restart allowed: each failing start-up costs an engine-core spawn and import (the budget's counting
    window and backoff are unit-tested, test_supervisor.py)."""
    flag, temp = tmp_path / "fail-engine-start", tmp_path / "tmp"
    temp.mkdir()
    srv = _start(sessions, tiny_model, tmp_path / "budget.log", "--guard-restart-max", "1", "--guard-restart-backoff",
                      "0.1", VLGUARD_TEST_FAIL_START_IF=str(flag), TMPDIR=str(temp))  # fmt: skip
    srv.wait_ready()
    flag.touch()  # from now on every engine start-up fails
    engine_core(srv).send_signal(signal.SIGKILL)
    assert srv.proc is not None
    assert srv.proc.wait(600) == 4, srv.log_tail()
    assert "restart budget spent" in srv.log_path.read_text()
    assert_session_ends(srv.proc.pid)
    assert_nothing_left(temp, srv.log_path)


def test_make_serve_sigterm(sessions: list[int], tiny_model: Path, tmp_path: Path) -> None:
    """``make serve`` as README gives it (make as the parent; no MODEL: the tiny model, found in the cache the
    ``tiny_model`` fixture built): SIGTERM to make reaches vlguard (GNU make passes it to its children),
    which stops, and nothing of the server is left: no process, nothing in the temp folder."""
    import vllm

    port, temp = free_port(), tmp_path / "tmp"
    temp.mkdir()
    log = (tmp_path / "make.log").open("wb")
    make = subprocess.Popen(["make", "--no-print-directory", "serve", f"VLLM={vllm.__version__}",
                             f"PORT={port}", "SERVE_ARGS=" + " ".join(EAGER)], cwd=REPO,
                            env=engine_env(**NO_COMPILE_WHEN_EAGER, TMPDIR=str(temp)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    sessions.append(make.pid)
    try:
        srv = ServerProcess([], tmp_path / "make.log", port=port)
        srv.proc = make
        srv.wait_ready()
        make.send_signal(signal.SIGTERM)
        status = make.wait(90)
        assert status != 0, status  # make reports its interrupted recipe
        assert_session_ends(srv.proc.pid)
        assert_nothing_left(temp, srv.log_path)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
        log.close()
