"""Engine processes end when vlguard ends, however it ends.

vLLM starts its engine-core process (and the engine core its workers) with ``multiprocessing`` (spawn).
When the API process dies without shutting them down (SIGKILL, a crash, an exit while an engine was still
being built) they are re-parented to init and keep their memory: on a GPU, the weights and the KV cache,
so the next vlguard cannot start.

Every process vLLM spawns under ``vlguard serve`` runs a daemon thread that compares ``os.getppid()``
with the process that spawned it every :data:`INTERVAL_S` seconds and SIGKILLs its own process when they
differ (the parent is gone). A worker's parent is the engine core, so a whole tree unwinds within a few
intervals. In a spawned child the watch starts at interpreter start-up, before the child imports torch
and vLLM (an import that takes seconds): ``vlguard serve`` puts :data:`BOOT_DIR` on ``PYTHONPATH``, whose
``sitecustomize`` calls :func:`boot`. In a forked child (vLLM's ``fork`` start method) an at-fork hook
starts it. The vLLM plugin ``vlguard_parent_watch`` (:func:`register`) starts it too, where
``PYTHONPATH`` was overridden.

Which process is the parent: ``VLGUARD_PARENT_PID``, set by ``vlguard serve`` to its own pid and by each
watched process to its own pid for its children; so a child whose parent died before the child started
still knows whom it belonged to.

Why not Linux's ``PR_SET_PDEATHSIG``: it fires when the parent *thread* that started the child exits, and
vlguard builds engines from a worker thread of the API process; the poll has no such trap and costs one
system call per interval. The API process's own shutdown ends the engine's processes itself
(:meth:`server.guard.supervisor.Supervisor.shutdown`); this watch covers the exits that run no code.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

ENV = "VLGUARD_PARENT_WATCH"  # "1": processes spawned under vlguard serve watch their parent
PARENT_ENV = "VLGUARD_PARENT_PID"
BOOT_DIR = Path(__file__).with_name("boot")  # holds the sitecustomize that calls boot()
INTERVAL_S = 0.5
logger = logging.getLogger("vllm.vlguard.parent_watch")


def parent_gone(expected_ppid: int) -> bool:
    """Whether this process's parent is no longer ``expected_ppid`` (it exited; we were re-parented)."""
    return os.getppid() != expected_ppid


def _watch_forever(expected_ppid: int) -> None:
    while True:
        if parent_gone(expected_ppid):
            logger.error("vlguard: parent process %d is gone; ending this process", expected_ppid)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(INTERVAL_S)


def watch(expected_ppid: int) -> None:
    """Start the watch of ``expected_ppid`` (once per process) and name this process the parent its own
    children watch. ``PARENT_ENV`` naming this process marks the watch as started (the boot loads this
    file as a module of its own, so a module global could not).

    Raises:
        RuntimeError: the thread could not be started (callers at start-up suppress it).
    """
    if os.environ.get(PARENT_ENV) == str(os.getpid()):
        return
    os.environ[PARENT_ENV] = str(os.getpid())
    threading.Thread(target=_watch_forever, args=(expected_ppid,), name="vlguard-parent-watch", daemon=True).start()


def _after_fork_in_child() -> None:
    """A forked child (``fork`` start method: vLLM's default on CUDA) runs no interpreter start-up and
    inherits vLLM's "plugins loaded" flag: start its watch here. Never raises."""
    with contextlib.suppress(Exception):
        if os.environ.get(ENV) == "1" and os.environ.get(PARENT_ENV):
            watch(int(os.environ[PARENT_ENV]))


def enable_for_children() -> None:
    """In the API process of ``vlguard serve``: every process it starts from now on watches it, whether
    spawned (``sitecustomize`` on ``PYTHONPATH`` calls :func:`boot`) or forked (an at-fork hook, inherited
    by forked children's own children)."""
    os.environ[ENV] = "1"
    os.environ[PARENT_ENV] = str(os.getpid())
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOT_DIR), path) if p)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def boot() -> None:
    """At interpreter start-up (``sitecustomize``): watch the parent if this is a ``multiprocessing``
    child under ``vlguard serve``. Never raises."""
    try:
        if os.environ.get(ENV) == "1" and "--multiprocessing-fork" in sys.argv:
            watch(int(os.environ.get(PARENT_ENV) or os.getppid()))
    except Exception:  # start-up of an engine process must not fail because of the watch
        pass


def register() -> None:
    """vLLM plugin entry point (``vlguard_parent_watch``): the same watch, started when vLLM loads its
    plugins, for a child whose interpreter start-up did not run :func:`boot`. Idempotent; never raises."""
    if os.environ.get(ENV) != "1":
        return
    try:
        parent = multiprocessing.parent_process()
        if parent is not None and parent.pid is not None:  # None: the API process itself
            watch(parent.pid)
    except Exception:
        logger.exception("vlguard: parent watch not started")
