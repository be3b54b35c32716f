"""No vLLM process outlives vlguard, whatever way vlguard ends (real processes, CASES C7 too).

Each server starts in a session of its own (``start_new_session``) and vLLM's processes stay in it, so
"the processes of that server" are those of its session, whatever they are called (vLLM retitles them,
which also overwrites what ``/proc`` shows of their environment) and whoever their parent now is. A
process counts as left over when it still exists and is not a zombie.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import assert_session_ends, engine_core, poll, process_name, session_processes, spare_processes
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


def _while_building(srv: ServerProcess) -> None:
    """Wait until the first engine build has spawned its engine core (start-up in progress)."""
    poll(lambda: any("EngineCore" in process_name(p) for p in srv.children()), 120, "the engine core to be spawned")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stop_during_first_startup(sessions: list[int], tiny_model: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM while the first engine loads does not wait for it (exit 143, "killed by SIGTERM");
    SIGKILL leaves the engine processes to notice on their own."""
    srv = _start(sessions, tiny_model, tmp_path / "server.log")
    _while_building(srv)
    assert srv.proc is not None and srv.proc.poll() is None
    signalled = time.monotonic()
    srv.proc.send_signal(sig)
    assert srv.proc.wait(60) == -sig, srv.log_tail()
    assert time.monotonic() - signalled < 20  # the engine build was abandoned, not waited for
    assert_session_ends(srv.proc.pid)


def test_sigkill_while_ready_with_requests_in_flight(sessions: list[int], tiny_model: Path, tmp_path: Path) -> None:
    import threading

    import httpx

    srv = _start(sessions, tiny_model, tmp_path / "server.log", *SPARE)
    srv.wait_ready()
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


def test_sigkill_during_a_rebuild(sessions: list[int], tiny_model: Path, tmp_path: Path) -> None:
    """The engine core is killed; while the replacement is being spawned, vlguard is SIGKILLed. The new
    engine's processes (spawned after the signal, or before it) end with it. (SIGTERM during a rebuild:
    test_guard.py's last test.)"""
    sig = signal.SIGKILL
    srv = _start(sessions, tiny_model, tmp_path / "server.log", *SPARE)  # the new engine runs in the spare
    srv.wait_ready()
    old = engine_core(srv)
    old.kill()
    poll(lambda: [p for p in srv.children() if "EngineCore" in process_name(p) and p.pid != old.pid], 120,
         "the replacement engine core to be spawned")  # fmt: skip
    assert srv.proc is not None
    srv.proc.send_signal(sig)
    assert srv.proc.wait(90) == -sig, srv.log_tail()
    assert_session_ends(srv.proc.pid)


def test_restart_failures_beyond_budget_exit_non_zero(sessions: list[int], tiny_model: Path, tmp_path: Path) -> None:
    """CASES C7: restarting keeps failing -> exit status 4 (never 0), and nothing is left behind. One
    restart allowed: each failing start-up costs an engine-core spawn and import (the budget's counting
    window and backoff are unit-tested, test_supervisor.py)."""
    flag = tmp_path / "fail-engine-start"
    srv = _start(sessions, tiny_model, tmp_path / "budget.log", "--guard-restart-max", "1", "--guard-restart-backoff",
                      "0.1", VLGUARD_TEST_FAIL_START_IF=str(flag))  # fmt: skip
    srv.wait_ready()
    flag.touch()  # from now on every engine start-up fails
    engine_core(srv).send_signal(signal.SIGKILL)
    assert srv.proc is not None
    assert srv.proc.wait(600) == 4, srv.log_tail()
    assert "restart budget spent" in srv.log_path.read_text()
    assert_session_ends(srv.proc.pid)


def test_make_serve_sigterm(sessions: list[int], tiny_model: Path, tmp_path: Path) -> None:
    """``make serve`` as README gives it (make as the parent; no MODEL: the tiny model, found in the cache the
    ``tiny_model`` fixture built): SIGTERM to make reaches vlguard (GNU make passes it to its children),
    which stops, and nothing of the server is left."""
    import vllm

    port = free_port()
    log = (tmp_path / "make.log").open("wb")
    make = subprocess.Popen(["make", "--no-print-directory", "serve", f"VLLM={vllm.__version__}",
                             f"PORT={port}", "SERVE_ARGS=" + " ".join(EAGER)], cwd=REPO,
                            env=engine_env(**NO_COMPILE_WHEN_EAGER), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    sessions.append(make.pid)
    try:
        srv = ServerProcess([], tmp_path / "make.log", port=port)
        srv.proc = make
        srv.wait_ready()
        make.send_signal(signal.SIGTERM)
        status = make.wait(90)
        assert status != 0, status  # make reports its interrupted recipe
        assert_session_ends(srv.proc.pid)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
        log.close()
