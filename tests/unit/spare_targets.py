"""Targets run in spare processes by test_spare.py (importable by a spawned child)."""

from __future__ import annotations

import json
import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any


def record(path: str) -> None:
    """Write this process's pid, name and environment to ``path`` (JSON)."""
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "name": multiprocessing.current_process().name, "env": dict(os.environ)}, f)


def use_lock_and_pipe(lock: Any, pipe: Connection) -> None:
    """Take ``lock`` and send this process's pid through ``pipe`` (what vLLM's worker gets: a lock and
    pipes created by its parent after the spare was spawned)."""
    with lock:
        pipe.send(os.getpid())
    pipe.close()
