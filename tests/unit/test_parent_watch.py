"""The parent watch (:mod:`server.engine.parent_watch`) in real processes: a ``multiprocessing`` child of a
process that is SIGKILLed ends on its own, with the watch started at interpreter start-up by the
``sitecustomize`` on ``PYTHONPATH`` (the child imports nothing of vlguard itself); without the watch it
would live on, re-parented to init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from server.engine import parent_watch
from tests.helpers import poll
from tests.servers import REPO

PARENT = textwrap.dedent(
    """
    import multiprocessing, os, sys, time

    def child():
        time.sleep(600)

    if __name__ == "__main__":
        if sys.argv[1] == "1":
            from server.engine import parent_watch
            parent_watch.enable_for_children()  # what vlguard serve does before building an engine
        proc = multiprocessing.get_context(sys.argv[2]).Process(target=child, daemon=False)
        proc.start()
        print(proc.pid, flush=True)
        time.sleep(600)
    """
)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("method", ["spawn", "fork"])  # vLLM: spawn on CPU, fork by default on CUDA
@pytest.mark.parametrize("watch", ["1", "0"])
def test_child_ends_when_its_parent_is_killed(watch: str, method: str, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"  # a file: spawn re-imports the parent's main module in the child
    script.write_text(PARENT)
    env = {k: v for k, v in os.environ.items() if k not in (parent_watch.ENV, parent_watch.PARENT_ENV)}
    env["PYTHONPATH"] = str(REPO)
    parent = subprocess.Popen([sys.executable, str(script), watch, method], env=env, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        parent.send_signal(signal.SIGKILL)  # at once: the child may not even have started its interpreter
        parent.wait(10)
        if watch == "1":
            poll(lambda: not _alive(child), 5, "the child to end")
        else:  # the control: nothing else ends it
            with pytest.raises(AssertionError):
                poll(lambda: not _alive(child), 2, "the child to end")
    finally:
        if child.is_running():
            child.kill()
