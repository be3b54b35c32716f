"""server.run_dirs: a server's folders carry their owner; the next start removes only those whose owner is
gone, and only its own user's; the owner removes its own at its end, a forked child nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import psutil
import pytest

from server import run_dirs, shm


def _folder(base: Path, kind: str, pid: int, started: int) -> Path:
    path = base / f"vlguard-{kind}-{pid}.{started}-abc123"
    path.mkdir()
    (path / "counter_1.db").write_bytes(b"x")
    return path


def test_the_next_start_removes_only_what_a_gone_owner_left(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_started = round(psutil.Process(gone.pid).create_time() * 100)
    gone.wait()
    me = psutil.Process()
    parent = psutil.Process(os.getppid())
    left = [_folder(tmp_path, "metrics", gone.pid, gone_started), _folder(tmp_path, "state", gone.pid, gone_started)]
    reused = _folder(tmp_path, "metrics", os.getppid(), round(parent.create_time() * 100) - 500)  # pid reused
    live = _folder(tmp_path, "state", os.getppid(), round(parent.create_time() * 100))
    mine = _folder(tmp_path, "metrics", me.pid, round(me.create_time() * 100))
    unknown_start = _folder(tmp_path, "state", os.getppid(), 0)
    old_style = tmp_path / "vlguard-metrics-q1w2e3"  # an older vlguard's: no owner in its name
    old_style.mkdir()
    other = tmp_path / "vlguard-bench-x"
    other.mkdir()
    segment = shared_memory.SharedMemory(create=True, size=4096)  # an engine's of the gone server
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    segment.close()
    (left[1] / "engine-2").mkdir()
    shm.record(left[1] / "engine-2", {segment.name})
    assert sorted(run_dirs.sweep(str(tmp_path))) == sorted([*left, reused])
    assert not (shm.SHM / segment.name).exists()  # released with its state folder
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, mine, unknown_start, old_style, other)
    )


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand a folder to another user")
def test_another_users_folders_are_left_alone(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    theirs = _folder(tmp_path, "metrics", gone.pid, 1)
    os.chown(theirs, 65534, 65534)
    assert run_dirs.sweep(str(tmp_path)) == []
    assert theirs.exists()


def test_the_owner_removes_its_folders_and_a_forked_child_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(run_dirs, "_made", [])
    metrics, state = run_dirs.make("metrics"), run_dirs.make("state")
    assert metrics.name.startswith(f"vlguard-metrics-{os.getpid()}.") and state.is_dir()
    assert run_dirs.sweep(str(tmp_path)) == []  # its owner runs
    child = os.fork()
    if child == 0:  # the child's exit handlers run (sys.exit), as a forked process's may
        run_dirs.remove_all()
        os._exit(0 if metrics.is_dir() else 1)
    assert os.waitpid(child, 0)[1] == 0
    run_dirs.remove_all()
    assert not metrics.exists() and not state.exists()
