"""Spare processes (server.guard.spare) with plain Python targets: hand-over, refusal, vLLM's start-up
path through an installed module, the keeper's replacement of a dead spare. Real spawned processes, no
vLLM."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from server.engine import spare as sp
from server.engine.protocol import STATE_DIR_ENV
from server.guard.hold import RebuildPath
from server.guard.spare import SpareKeeper
from server.metrics import definitions as m
from tests.helpers import gone, poll
from tests.unit import spare_targets

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def spare() -> Iterator[sp.Spare]:
    """A spare spawned in the test's environment (pytest changes ``PYTEST_CURRENT_TEST`` between a
    fixture's set-up and the test, which a hand-over would see as a different environment)."""
    os.environ["PYTEST_CURRENT_TEST"] = os.environ.get("PYTEST_CURRENT_TEST", "").replace("(setup)", "(call)")
    s = sp.Spare(modules=("json",))
    yield s
    s.end()
    if s.proc.is_alive():
        s.proc.kill()
    s.proc.join(5)


def test_env_differences_ignore_per_engine_variables_and_duplicate_path_entries() -> None:
    spawned = {"A": "1", STATE_DIR_ENV: "/s/engine-1", "LD_LIBRARY_PATH": "/x:", "PATH": "/a:/b"}
    now = {"A": "1", STATE_DIR_ENV: "/s/engine-2", "LD_LIBRARY_PATH": "/x:/x:", "PATH": "/a:/b"}
    assert sp.env_differences(spawned, now) == []
    assert sp.env_differences(spawned, {**now, "A": "2", "B": "", "PATH": "/b:/a"}) == ["A", "B", "PATH"]


def test_hand_over_runs_the_target_in_the_spare_with_the_environment_of_now(
    spare: sp.Spare, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert spare.ready(timeout_s=60)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "engine-2"))  # the next engine's: applied at hand-over
    out = tmp_path / "out.json"
    assert spare.hand_over(spare_targets.record, {"path": str(out)}, "EngineCore")
    spare.proc.join(30)
    assert spare.proc.exitcode == 0
    got = json.loads(out.read_text())
    assert got["pid"] == spare.pid
    assert got["name"] == "EngineCore"
    assert got["env"][STATE_DIR_ENV] == str(tmp_path / "engine-2")
    assert not spare.alive() and spare.state == "used"


def test_a_spare_spawned_with_another_environment_is_refused_and_ended(
    spare: sp.Spare, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # read when torch loads: a spare without it would differ
    assert not spare.hand_over(spare_targets.record, {"path": str(tmp_path / "out.json")}, "EngineCore")
    spare.proc.join(10)
    assert not spare.proc.is_alive() and spare.state == "ended"
    assert not (tmp_path / "out.json").exists()


@pytest.fixture
def starter(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A module that starts processes the way vLLM's do (``get_mp_context().Process(...)``)."""
    module = types.ModuleType("fake_vllm_starter")
    module.get_mp_context = lambda: multiprocessing.get_context("spawn")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    sp.install(module.__name__)
    sp.install(module.__name__)  # idempotent
    return module


def test_an_installed_module_starts_its_process_in_the_armed_spare_with_a_lock_and_pipes(
    spare: sp.Spare, starter: types.ModuleType
) -> None:
    sp.arm(spare, "VllmWorker", wait_ready_s=60)  # as the engine core's spare arms its worker spare
    context = starter.get_mp_context()
    lock = context.Lock()  # only inheritable at spawn for multiprocessing: the hand-over sends it by name
    reader, writer = context.Pipe(duplex=False)
    proc = context.Process(
        target=spare_targets.use_lock_and_pipe, kwargs={"lock": lock, "pipe": writer}, name="VllmWorker-0", daemon=True
    )
    proc.start()
    writer.close()
    assert reader.poll(60), "the spare never answered"
    assert reader.recv() == spare.pid == proc.pid
    proc.join(30)
    assert proc.exitcode == 0
    assert sp.disarm("VllmWorker") is None  # taken by the start


def test_an_installed_module_spawns_as_usual_when_nothing_is_armed_or_the_spare_is_gone(
    spare: sp.Spare, starter: types.ModuleType, tmp_path: Path
) -> None:
    context = starter.get_mp_context()
    plain = context.Process(target=spare_targets.record, kwargs={"path": str(tmp_path / "a.json")}, name="VllmWorker-0")
    plain.start()
    plain.join(60)
    assert json.loads((tmp_path / "a.json").read_text())["pid"] not in (spare.pid, os.getpid())

    sp.arm(spare, "VllmWorker")
    spare.proc.kill()
    spare.proc.join(10)
    proc = context.Process(target=spare_targets.record, kwargs={"path": str(tmp_path / "b.json")}, name="VllmWorker-0")
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert json.loads((tmp_path / "b.json").read_text())["pid"] == proc.pid != spare.pid


def test_the_keeper_replaces_a_dead_spare_after_a_back_off_counts_it_and_ends_it_at_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CPU platform sets
    now = [0.0]
    keeper = SpareKeeper(modules=("json",), backoff_s=10, clock=lambda: now[0])
    died = m.SPARE_EVENTS.labels(event="died")._value.get()

    def path() -> str:  # the path, as /ready and its one-hot gauge say it
        (hot,) = [p for p in RebuildPath if m.REBUILD_PATH.labels(path=p.value)._value.get() == 1]
        assert keeper.path() is hot
        return hot.value

    try:
        assert keeper.path() is RebuildPath.COLD
        keeper.replenish(None)  # no engine configuration: no worker spare
        first = keeper.spare
        assert first is not None
        assert path() == "spare_starting"  # a rebuild now would wait for the rest of its imports
        poll(lambda: first.ready(0.1), 60, "the spare to be ready")
        keeper.check()
        assert m.SPARE_UP._value.get() == 1 and path() == "spare"
        victim = psutil.Process(first.pid)
        victim.kill()
        poll(lambda: gone(victim), 10, "the killed spare to exit")
        keeper.check()
        assert m.SPARE_EVENTS.labels(event="died")._value.get() == died + 1
        assert keeper.spare is None and m.SPARE_UP._value.get() == 0 and path() == "cold"
        now[0] = 9.9
        keeper.check()
        assert keeper.spare is None  # inside the back-off: a spare dying while it imports is not respawned each tick
        now[0] = 10.0
        keeper.check()
        assert keeper.spare is not None and keeper.spare.pid != first.pid
        second = psutil.Process(keeper.spare.pid)
    finally:
        keeper.close()
    assert gone(second)
    assert m.SPARE_UP._value.get() == 0
    keeper.replenish(None)
    assert keeper.spare is None  # closed: nothing is spawned after shutdown


def test_a_handed_process_answers_like_an_unstarted_one_before_start() -> None:
    handed = sp._HandedProcess(multiprocessing.get_context("spawn"), (None, 0.0), spare_targets.record, "EngineCore")  # type: ignore[arg-type]
    assert (handed.pid, handed.exitcode, handed.is_alive(), handed.name) == (None, None, False, "EngineCore")


def test_the_keeper_keeps_no_spare_where_vllm_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's default start method (CUDA, nothing forcing spawn) forks: no import to save."""
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    keeper = SpareKeeper(modules=("json",))
    keeper.replenish(None)
    assert keeper.spare is None
    keeper.close()
