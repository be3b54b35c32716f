"""Engine liveness checks that do not trust vLLM's own flag: the engine-core process and progress.

A SIGKILLed engine core is noticed by vLLM itself; a SIGSTOPped or deadlocked one is not (stock
``/health`` keeps answering 200). These checks look at the process with psutil and at output progress.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from server.engine.protocol import FatalRecord


class DeathCause(enum.StrEnum):
    """Why an engine was declared dead (``vlguard_engine_deaths_total{cause}``)."""

    DEEPSTACK = "deepstack"  # the deepstack buffer ValueError (stock vLLM 0.20.0 under CUDA graphs)
    PROCESS_EXIT = "process_exit"  # engine-core process gone (killed, crashed, OOM-killed)
    HANG = "hang"  # stopped process, or work pending with no output for too long
    EXCEPTION = "exception"  # any other fatal error inside the engine


def process_tree(pids: list[int]) -> list[psutil.Process]:
    """The processes and all their descendants that still exist."""
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return procs


def process_problem(pids: list[int]) -> DeathCause | None:
    """``PROCESS_EXIT`` when an engine-core process is gone or a zombie, ``HANG`` when it is stopped."""
    for pid in pids:
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            return DeathCause.PROCESS_EXIT
        if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return DeathCause.PROCESS_EXIT
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return DeathCause.HANG
    return None


def kill_tree(pids: list[int], known: Sequence[psutil.Process] = ()) -> list[int]:
    """SIGKILL the processes and their descendants (a hung or stopped child cannot shut down cleanly), and
    the ``known`` processes of that tree recorded earlier that still run: once an engine core is killed,
    its workers are orphans (their parent is init), out of reach of a descendant search, and on a busy
    CPU their own parent-death watch can take a minute to fire (measured: a worker bound to a core shared
    with another engine outlived its killed engine core by 80 s, starving the rebuild). psutil's
    ``is_running`` compares creation times, so a reused PID is never hit.

    Returns:
        The PIDs that were killed.
    """
    procs = process_tree(pids)
    seen = {p.pid for p in procs}
    procs += [p for p in known if p.pid not in seen and p.is_running()]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


def descendant_pids(pid: int | None = None) -> set[int]:
    """The PIDs of every process below ``pid`` (default: this process); none if it is gone."""
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def end_descendants(grace_s: float, keep: Collection[int] = ()) -> list[int]:
    """End every process below this one but those in ``keep`` and theirs: SIGTERM, up to ``grace_s``
    seconds to exit, then SIGKILL.

    multiprocessing's resource tracker is left alone: it ignores SIGTERM by design, cleans up leaked
    shared memory and semaphores once the last holder of its pipe is gone, and then exits by itself.

    Returns:
        The PIDs that were signalled.
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    kept = set(keep).union(*(descendant_pids(pid) for pid in keep))
    procs = [p for p in psutil.Process().children(recursive=True) if p.pid != tracker and p.pid not in kept]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)
    return [p.pid for p in procs]


def classify(record: FatalRecord | None, pids: list[int]) -> DeathCause:
    """The cause of a death vLLM reported (``EngineDeadError``).

    Arguments:
        record: what the engine core recorded before dying (see :mod:`server.engine.fatal`), or None.
        pids: the engine-core PIDs, to tell a killed process from an exception.
    """
    if record is not None:
        return exception_cause(record.describe())
    return process_problem(pids) or DeathCause.PROCESS_EXIT


def exception_cause(description: str) -> DeathCause:
    """The cause of a fault an engine step raised, from its ``"<Type>: <message>"``."""
    return DeathCause.DEEPSTACK if "deepstack" in description else DeathCause.EXCEPTION
