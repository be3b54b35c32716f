"""Shared-memory segments (and named semaphores) an engine's processes made, released when the engine is gone.

vLLM's engine core and workers talk through POSIX shared memory (``/dev/shm/psm_*``, its message queues:
160-240 MiB each, sparse). A process that is killed cannot unlink its segments: they stay until
multiprocessing's resource tracker exits with the server ("leaked shared_memory objects"), or for good when
the tracker is killed with it. vlguard notes the segments each engine's processes map (:func:`mapped`, at
build and again at teardown), writes them into the engine's state folder (:func:`record`), and unlinks them
once those processes are gone (:func:`release`); a left-over state folder's are released by the next start
(:func:`server.run_dirs.sweep`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
RECORD = "shm-segments"
#: multiprocessing's names in /dev/shm: shared_memory segments (vLLM's queues) and named semaphores (``sem.``
#: and the name)
_SEGMENT = re.compile(r"^(?:psm_[0-9a-f]+|sem\.mp-[a-z0-9_]+)$")


def mapped(pids: Iterable[int]) -> set[str]:
    """Names of the shared-memory segments (``/dev/shm``) the processes ``pids`` map now."""
    names = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.startswith("/dev/shm/") and _SEGMENT.match(name := path[len("/dev/shm/") :]):
                    names.add(name)
    return names


def record(directory: Path, names: Iterable[str]) -> None:
    """Add ``names`` to the segments recorded in ``directory`` (an engine's state folder)."""
    with contextlib.suppress(OSError), open(directory / RECORD, "a") as out:
        out.writelines(f"{name}\n" for name in sorted(names))


def recorded(directory: Path) -> set[str]:
    """The segments recorded in ``directory`` and the folders below it."""
    names: set[str] = set()
    for file in [directory / RECORD, *directory.glob(f"*/{RECORD}")]:
        with contextlib.suppress(OSError):
            names.update(n for n in file.read_text().split() if _SEGMENT.match(n))
    return names


def release(names: Iterable[str], tracked: bool = True) -> list[str]:
    """Unlink the segments ``names`` (their makers are gone); ``tracked``: they were made under this
    process's resource tracker (its engine processes share it), which is told, so that it does not report
    them leaked (an untracked name would make it print a traceback). Returns those unlinked."""
    from multiprocessing import resource_tracker

    released = []
    for name in names:
        if not _SEGMENT.match(name):
            continue
        with contextlib.suppress(OSError):
            os.unlink(SHM / name)
            released.append(name)
            if tracked:
                kind, tracked_as = ("semaphore", name[4:]) if name.startswith("sem.") else ("shared_memory", name)
                with contextlib.suppress(Exception):
                    resource_tracker.unregister(f"/{tracked_as}", kind)
    return released
