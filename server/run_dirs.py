"""A server's private folders in the system temp folder (its Prometheus multiprocess folder, its engines'
state folder), and their end.

Each is named ``vlguard-<kind>-<pid>.<start>-<random>`` after the process that made it (its pid and its start
time, in hundredths of a second since the epoch: a pid reused later is another owner). The owner removes its
folders however it ends: at exit, and before it ends itself by the signal that stopped it (a signal's default
action runs no exit handler). A folder whose owner is gone (SIGKILL, a power cut) is removed by the next
``vlguard serve`` on the machine (:func:`sweep`); folders of other users and of older vlguard, named without an
owner, are left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import psutil

from server import shm

logger = logging.getLogger(__name__)

_NAME = re.compile(r"vlguard-(?:metrics|state)-(\d+)\.(\d+)-")
_made: list[Path] = []
_owner = 0  # the pid that made them: a forked child that exits normally removes nothing of its parent's


def _started(pid: int) -> int | None:
    """When ``pid`` started (hundredths of a second since the epoch; 0: unknown), or None when no such process
    runs."""
    try:
        return round(psutil.Process(pid).create_time() * 100)
    except psutil.NoSuchProcess:
        return None
    except (psutil.Error, OSError, ValueError):
        return 0


def make(kind: str) -> Path:
    """A new private folder ``vlguard-<kind>-...`` of this process in the temp folder, removed at its end."""
    global _owner
    if _owner != os.getpid():
        _made.clear()
        _owner = os.getpid()
        atexit.register(remove_all)
    path = Path(tempfile.mkdtemp(prefix=f"vlguard-{kind}-{_owner}.{_started(_owner)}-"))
    _made.append(path)
    return path


def remove_all() -> None:
    """Remove this process's folders (:func:`make`); a forked child's call removes nothing. Never raises."""
    if _owner != os.getpid():
        return
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)


def sweep(base: str | None = None) -> list[Path]:
    """Remove the folders in ``base`` (the temp folder) that a vlguard process now gone made, and that
    belong to this user.

    Returns:
        The folders removed.
    """
    removed = []
    for entry in Path(base or tempfile.gettempdir()).glob("vlguard-*-*"):
        match = _NAME.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid != os.getuid():
                continue
            pid, started = int(match[1]), int(match[2])
            now = _started(pid)
            if pid == os.getpid() or (now is not None and (not now or not started or abs(now - started) <= 1)):
                continue  # its owner runs (or may: a start time unknown)
            shm.release(shm.recorded(entry), tracked=False)  # its engines' shared memory
            shutil.rmtree(entry)
            removed.append(entry)
    if removed:
        logger.info("removed %d folder(s) left by vlguard processes that are gone", len(removed))
    return removed
