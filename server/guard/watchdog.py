"""Engine liveness checks that do not trust vLLM's own flag: the engine-core process and progress.

A SIGKILLed engine core is noticed by vLLM itself; a SIGSTOPped or deadlocked one is not (stock
``/health`` keeps answering 200). These checks look at the process with psutil and at output progress.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any

import psutil


class DeathCause(str, enum.Enum):
    """Why an engine was declared dead (``vlguard_engine_deaths_total{cause}``)."""

    DEEPSTACK = "deepstack"  # the deepstack buffer ValueError (stock vLLM 0.20.0 under CUDA graphs)
    PROCESS_EXIT = "process_exit"  # engine-core process gone (killed, crashed, OOM-killed)
    HANG = "hang"  # stopped process, or work pending with no output for too long
    EXCEPTION = "exception"  # any other fatal error inside the engine


def engine_core_pids(engine: Any) -> list[int]:
    """PIDs of the engine-core processes of an ``AsyncLLM`` (empty when not found)."""
    with contextlib.suppress(AttributeError):
        manager = engine.engine_core.resources.engine_manager
        return [p.pid for p in manager.processes if p.pid is not None]
    return []


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


def kill_tree(pids: list[int]) -> list[int]:
    """SIGKILL the processes and their descendants (a hung or stopped child cannot shut down cleanly).

    Returns:
        The PIDs that were killed.
    """
    procs = process_tree(pids)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


def classify(fatal_message: str | None, pids: list[int]) -> DeathCause:
    """The cause of a death vLLM reported (``EngineDeadError``).

    Arguments:
        fatal_message: what the engine core recorded before dying (see :mod:`server.guard.fatal`).
        pids: the engine-core PIDs, to tell a killed process from an exception.
    """
    if fatal_message and "deepstack" in fatal_message:
        return DeathCause.DEEPSTACK
    if fatal_message:
        return DeathCause.EXCEPTION
    return process_problem(pids) or DeathCause.PROCESS_EXIT
