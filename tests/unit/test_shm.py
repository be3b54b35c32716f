"""server.shm on real POSIX shared memory: the segments a process maps are found from outside it, recorded
in a state folder, and unlinked once it is killed (as the resource tracker would only at the server's end,
or never when it is killed too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from server import shm

MAKER = """
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(segment._name, "shared_memory")  # as if its tracker were killed with it
print(segment.name, flush=True)
input()
"""


def test_a_killed_processs_segments_are_found_recorded_and_released(tmp_path: Path) -> None:
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout is not None
        name = maker.stdout.readline().strip()
        assert shm.mapped([maker.pid]) == {name}
        shm.record(tmp_path / "engine-1", set())  # no folder: nothing recorded, nothing raised
        (tmp_path / "engine-1").mkdir()
        shm.record(tmp_path / "engine-1", {name, "not-a-segment"})
    finally:
        maker.kill()
        maker.wait()
    assert (shm.SHM / name).exists()  # nobody unlinked it
    assert shm.recorded(tmp_path) == {name}
    assert shm.release({name, "psm_0000", "../etc"}, tracked=False) == [name]
    assert not (shm.SHM / name).exists()
