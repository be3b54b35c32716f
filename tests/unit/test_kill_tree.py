"""``watchdog.kill_tree``: an engine core's workers are orphans once it is killed; the teardown still ends them."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from server.guard import watchdog
from tests.helpers import gone, poll

#: A parent that starts a child and waits; the child prints its pid, then sleeps.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_an_orphaned_worker_recorded_at_start_is_killed_with_its_dead_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    try:
        tree = watchdog.process_tree([parent.pid])  # recorded while the engine is up
        assert child_pid in {p.pid for p in tree}
        parent.send_signal(signal.SIGKILL)  # the engine core dies; its child is an orphan now
        parent.wait(10)
        child = psutil.Process(child_pid)
        assert watchdog.process_tree([parent.pid]) == []  # out of reach of a descendant search
        killed = watchdog.kill_tree([parent.pid], tree)
        assert killed == [child_pid]
        poll(lambda: gone(child), 10, "the orphan ended")
    finally:
        if psutil.pid_exists(child_pid):
            psutil.Process(child_pid).kill()
