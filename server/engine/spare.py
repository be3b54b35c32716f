"""Spare engine processes: a rebuild's engine core and worker, spawned and imported before a death.

This module is the spare's process side (what runs in the spare, and the hand-over inside vLLM's start-up
code); the API process keeps one ready with :class:`server.guard.spare.SpareKeeper`.

A rebuild after a real process death (SIGKILL, OOM kill, segfault) spends most of its time starting two
fresh Python processes, the engine core and its model worker, each importing torch and vLLM (measured on
the 2-core CI machine: ~10 s and ~12 s of a 26.7 s rebuild). vLLM starts both with ``multiprocessing``
(``spawn`` on its CPU platform, which forces it; on CUDA whenever the parent has touched the GPU), through
``get_mp_context()``. A :class:`Spare` is such a process started ahead of time: it imports the modules
the role needs, then waits, without touching a device, until a rebuild hands it the ``target`` and
``kwargs`` vLLM would have given a new process. The engine core's spare spawns the worker's spare itself,
so the worker is the engine core's child, as vLLM expects (it joins and terminates it).

The hand-over happens inside vLLM's own start-up code: :func:`install` replaces ``get_mp_context`` in the
module that starts the process with one whose ``Process`` takes the armed spare (:func:`arm`). If the
spare is dead, was spawned with a different environment (besides vlguard's per-engine variables, applied
at hand-over), or the arguments cannot be sent to a running process, the new process is spawned as vLLM
would have (the spare is discarded), so a spare can make a rebuild faster but never different.

Why a spare and not a fork server: vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
unconditionally, and a ``forkserver`` child would start its own fork server (and import again) for the
worker. A spare keeps vLLM's start method and process tree as they are.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Mapping
from multiprocessing import synchronize
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import psutil

from server.engine.protocol import PER_ENGINE_ENV, PER_PROCESS_ENV
from server.vllm_hooks import processes

logger = logging.getLogger("vllm.vlguard.spare")

#: What an engine-core spare imports. The scheduler modules (vLLM's, and the asynchronous one vlguard's
#: aligned scheduler also imports) are imported only once the engine core has built its executor and KV
#: cache (~3 s on the 2-core machine, seen in a rebuild's log after "init engine").
CORE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler",
)
#: Cached per process, computed during a CPU worker's first ``torch.compile`` (vLLM compiles its CPU
#: sampler even with --enforce-eager): which vector ISA the C++ compiler supports (two ``python -c``
#: subprocesses importing torch) and hashes of torch's and triton's sources. Profiled in a rebuild's
#: warm-up: ~5 of its 14 s on the 2-core CI machine. A CPU worker's spare computes them while it waits.
CPU_WORKER_WARM_CALLS = (
    "torch._inductor.cpu_vec_isa:pick_vec_isa",
    "torch._inductor.codecache:torch_key",
    "triton.runtime.cache:triton_key",
)
READY = b"ready"  # a spare's message once it has imported and warmed up
#: The niceness of a spare's imports and warm-up (:func:`_prepare`): the lowest CPU priority there is.
PREPARE_NICENESS = 19
WORKER_WAIT_READY_S = 300.0  # a worker's hand-over waits this long for its spare (its pipes need a ready one)
CORE_PROCESS = "EngineCore"  # vLLM's name of the engine-core process (EngineCore_DP<n> with data parallel)
WORKER_PROCESS = "VllmWorker"  # vLLM's name of a worker process (VllmWorker-<rank>)


def env_differences(spawned: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """Names of the variables, besides vlguard's per-engine and per-process ones, whose value differs
    between the environment a spare was spawned with and the one a new process would get now. Search
    paths (``*PATH``) compare as their distinct entries in order: importing OpenCV prepends its library
    directory to ``LD_LIBRARY_PATH`` once per import, a duplicate that changes no lookup."""
    ignored = PER_ENGINE_ENV | PER_PROCESS_ENV
    return sorted(
        k for k in spawned.keys() | now.keys() if k not in ignored and _norm(k, spawned.get(k)) != _norm(k, now.get(k))
    )


def _norm(key: str, value: str | None) -> object:
    if value is None or not key.endswith("PATH"):
        return value
    return tuple(dict.fromkeys(p for p in value.split(os.pathsep) if p))


class _HandOverPickler(ForkingPickler):
    """``multiprocessing``'s pickler, plus its semaphores: vLLM gives each worker a ``Lock``, which
    ``multiprocessing`` only lets a process inherit at spawn. On Linux a spawn-context lock is a named
    POSIX semaphore that stays until its creator drops it, so a running process can open it by name."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, synchronize.SemLock):
            lock = obj._semlock  # type: ignore[attr-defined]
            if lock.name is None:  # unlinked at creation (fork context): cannot be opened by name
                raise pickle.PicklingError("a fork-context lock cannot reach a running process")
            return _rebuild_semlock, (type(obj), (lock.handle, lock.kind, lock.maxvalue, lock.name))
        return NotImplemented


def _rebuild_semlock(cls: Any, state: tuple[Any, ...]) -> Any:
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    _HandOverPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Spare:
    """One spawned process that has imported ``modules`` and waits to become a process vLLM starts.

    Arguments:
        modules: imported by the spare before it waits (names; a failed import is logged, not fatal).
        warm_calls: ``"module:function"`` called without arguments after the imports (results cached by
            the callee for the process; a failure is logged, not fatal).
        worker_spare_for: for an engine core's spare, the ``VllmConfig`` of the engine it will run; the
            spare then spawns its own worker spare (one worker: tensor x pipeline parallel size 1), with
            the worker environment vLLM's CPU executor sets for rank 0.
        context: the ``multiprocessing`` context (spawn by default).
    """

    def __init__(
        self,
        modules: Iterable[str],
        worker_spare_for: object | None = None,
        context: Any = None,
        warm_calls: Iterable[str] = (),
    ) -> None:
        ctx = context or multiprocessing.get_context("spawn")
        self._conn: Connection
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.env = dict(os.environ)  # what the spawned process starts with
        self.proc = ctx.Process(
            target=_spare_main,
            args=(child_conn, tuple(modules), worker_spare_for, tuple(warm_calls)),
            name="vlguard-spare",
            daemon=worker_spare_for is None,  # a daemon process may not have children (the worker spare)
        )
        self.proc.start()
        child_conn.close()
        self.state = "waiting"  # then "used" (handed over) or "ended" (refused, or ended unused)
        self._ready = False
        self._lock = threading.Lock()  # hand_over (a build thread) vs end (shutdown)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the spare has imported and warmed up (waiting at most ``timeout_s`` seconds for it);
        False once it is gone or handed over."""
        if not self._ready and self.alive():
            with contextlib.suppress(EOFError, OSError):
                self._ready = self._conn.poll(timeout_s) and self._conn.recv_bytes() == READY
        return self._ready and self.alive()

    def alive(self) -> bool:
        """Spawned, not handed over, and still running."""
        return self.state == "waiting" and self.proc.is_alive()

    def hand_over(
        self, target: Callable[..., object], kwargs: dict[str, Any], name: str, wait_ready_s: float = 0.0
    ) -> bool:
        """Make the spare run ``target(**kwargs)`` as process ``name``, with this process's values of the
        per-engine variables (the rest of its environment is what it was spawned with, plus what its own
        imports set, as in a fresh process).

        Arguments:
            wait_ready_s: wait up to this long for a spare still importing to be ready; 0: hand over
                at once (the message waits in the spare's pipe until its imports are done). Arguments
                holding pipes need a ready spare: they travel through this process's resource sharer, and
                a spare dying before it collected them would leave the pipe's other end open here.

        Returns:
            False (and the spare is ended) when it cannot: not alive, not ready in time, spawned with a
            different environment, or ``kwargs`` cannot reach a running process; the caller spawns as usual.
        """
        if wait_ready_s and not self.ready(timeout_s=wait_ready_s):
            logger.warning("spare process %s not ready within %.0f s; spawning %s", self.pid, wait_ready_s, name)
            self.end()
            return False
        if not self.alive():
            logger.warning("spare process %s is gone; spawning %s", self.pid, name)
            return False
        now = dict(os.environ)
        if differ := env_differences(self.env, now):
            logger.warning("spare process %s not used for %s: environment differs (%s)", self.pid, name, differ)
            self.end()
            return False
        try:
            payload = _dumps((target, kwargs, {k: now.get(k) for k in PER_ENGINE_ENV}, name))
            with self._lock:
                if self.state != "waiting":
                    raise OSError("ended meanwhile (shutdown)")
                self._conn.send_bytes(payload)
                self.state = "used"
        except (pickle.PicklingError, TypeError, RuntimeError, OSError) as exc:
            logger.warning("spare process %s not used for %s: %s", self.pid, name, exc)
            self.end()
            return False
        self._conn.close()
        logger.info("%s runs in spare process %s", name, self.pid)
        return True

    def end(self) -> None:
        """End an unused spare and its worker spare (SIGKILL, children first: the spare may be importing,
        and a child outliving it would only end by its parent watch). Idempotent."""
        with self._lock:
            if self.state != "waiting":
                return
            self.state = "ended"
        with contextlib.suppress(OSError):
            self._conn.close()
        with contextlib.suppress(psutil.Error):
            procs = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.pid else []
            for proc in [*procs, psutil.Process(self.proc.pid)]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(procs, timeout=5)
        self.proc.join(5)


def _spare_main(
    conn: Connection, modules: tuple[str, ...], worker_spare_for: object | None, warm_calls: tuple[str, ...] = ()
) -> None:  # pragma: no cover - runs in the spare process
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle("vlguard::spare")  # vLLM retitles it at hand-over (VLLM::EngineCore)
    worker = _spawn_worker_spare(worker_spare_for) if worker_spare_for is not None else None
    preparing = threading.Thread(target=_prepare, args=(modules, warm_calls), name="vlguard-spare-imports")
    preparing.start()
    preparing.join()
    # READY once the worker spare is. A hand-over arriving first does not wait for it (the worker's own
    # hand-over waits for it). A worker spare that dies while waiting ends this spare too: the keeper
    # replaces the pair, and the gauge never counts a spare without its worker.
    told = False
    while not conn.poll():
        if worker is not None and not worker.alive():
            return
        if not told and (worker is None or worker.ready()):
            with contextlib.suppress(OSError):
                conn.send_bytes(READY)
            told = True
        waitables: list[Any] = [conn]
        if worker is not None:
            waitables += [worker.proc.sentinel] + ([] if worker.ready() else [worker._conn])
        multiprocessing.connection.wait(waitables)
    if worker is not None and not worker.alive():
        worker = None  # died with the hand-over on its way: the engine core spawns its worker
    try:
        target, kwargs, env, name = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):  # never needed: the API process ended it, or is gone
        return
    conn.close()
    for key, value in env.items():  # the rest is as a fresh process would have it (hand_over checked)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    multiprocessing.current_process().name = name
    if worker is not None:
        try:
            install(processes.WORKER_STARTER)
            arm(worker, WORKER_PROCESS, wait_ready_s=WORKER_WAIT_READY_S)
        except (ImportError, AttributeError):
            logger.warning("spare: this vLLM starts its workers elsewhere; the worker is spawned", exc_info=True)
            worker.end()
    target(**kwargs)


def _prepare(modules: tuple[str, ...], warm_calls: tuple[str, ...]) -> None:  # pragma: no cover - in the spare
    """Import ``modules`` and make the ``warm_calls`` at the niceness :data:`PREPARE_NICENESS`, in a thread of
    the spare's own: the serving engine's processes come first. On Linux a thread's niceness is its own
    (and that of the threads it starts), so the spare's main thread, which serves after the hand-over, keeps
    the server's priority: taking a niceness back needs CAP_SYS_NICE, which a service rarely has."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICENESS)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:
            logger.exception("spare: importing %s failed", module)
    for call in warm_calls:
        module_name, _, function = call.partition(":")
        try:
            getattr(importlib.import_module(module_name), function)()
        except Exception:
            logger.warning("spare: warm-up call %s failed", call, exc_info=True)


def _spawn_worker_spare(vllm_config: Any) -> Spare | None:  # pragma: no cover - runs in the spare process
    """The worker's spare, spawned with the environment vLLM's CPU executor gives rank 0 (OpenMP thread
    count and binding are read when torch loads, so they must be right at spawn)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None or parallel.world_size != 1 or parallel.distributed_executor_backend != "mp":
        return None  # several workers, or none of its own (the "uni" executor runs the model in the engine core)
    modules = ["vllm.v1.executor.multiproc_executor"]
    if isinstance(getattr(parallel, "worker_cls", None), str) and "." in parallel.worker_cls:
        modules.append(parallel.worker_cls.rsplit(".", 1)[0])
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        omp_envs: contextlib.AbstractContextManager[object] = OMPProcessManager(vllm_config).configure_omp_envs(
            rank=0, local_rank=0
        )
    except Exception:  # another vLLM: the worker's environment check decides
        omp_envs = contextlib.nullcontext()
    try:
        from vllm.platforms import current_platform

        warm = CPU_WORKER_WARM_CALLS if current_platform.is_cpu() else ()
    except Exception:
        warm = ()
    with omp_envs:
        return Spare(modules, warm_calls=warm)


# -- the hand-over inside vLLM's start-up code ------------------------------------------------------------
_armed: dict[str, tuple[Spare, float]] = {}  # process-name prefix -> (spare, seconds to wait for it to be ready)
_armed_lock = threading.Lock()


def arm(spare: Spare, process_name: str, wait_ready_s: float = 0.0) -> None:
    """The next process named ``process_name``* that an installed module starts runs in ``spare``
    (see :meth:`Spare.hand_over` for ``wait_ready_s``)."""
    with _armed_lock:
        _armed[process_name] = (spare, wait_ready_s)


def disarm(process_name: str) -> Spare | None:
    """Take back the armed spare for ``process_name`` (None if a start took it)."""
    with _armed_lock:
        armed = _armed.pop(process_name, None)
    return armed[0] if armed else None


def _take(name: str) -> tuple[Spare, float] | None:
    with _armed_lock:
        for prefix in list(_armed):
            if name.startswith(prefix):
                return _armed.pop(prefix)
    return None


class _HandedProcess:
    """What vLLM gets from ``Process(...)``: ``start()`` hands the target to the armed spare, or spawns;
    everything else (``pid``, ``sentinel``, ``join``, ``terminate``, ``exitcode``...) is the process's."""

    def __init__(
        self, context: Any, armed: tuple[Spare, float], target: Callable[..., object], name: str, **kwargs: Any
    ) -> None:
        self._context, self._target, self._kwargs = context, target, kwargs
        self._armed: tuple[Spare, float] | None = armed
        self._name = name
        self._proc: Any = None

    def start(self) -> None:
        armed, self._armed = self._armed, None
        kwargs = dict(self._kwargs.get("kwargs") or {})
        if armed is not None and not self._kwargs.get("args"):
            spare, wait_ready_s = armed
            if spare.hand_over(self._target, kwargs, self._name, wait_ready_s=wait_ready_s):
                self._proc = spare.proc
                return
        self._proc = self._context.Process(target=self._target, name=self._name, **self._kwargs)
        self._proc.start()

    @property
    def name(self) -> str:
        return self._name

    # What a multiprocessing process answers before start() (vLLM's clean-up may ask after a failed one).
    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return None if self._proc is None else self._proc.exitcode

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def __getattr__(self, attr: str) -> Any:
        if self._proc is None:
            raise AttributeError(f"{attr}: process not started")
        return getattr(self._proc, attr)


class _HandOverContext:
    """A ``multiprocessing`` context whose ``Process`` may run in an armed spare; all else is the real one."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def Process(self, target: Callable[..., object], name: str | None = None, **kwargs: Any) -> Any:
        armed = _take(name or "")
        if armed is None:
            return self._context.Process(target=target, name=name, **kwargs)
        return _HandedProcess(self._context, armed, target, name or "", **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._context, attr)


def install(module_name: str) -> None:
    """Route the processes ``module_name`` starts through :func:`arm`'s spares: its ``get_mp_context``
    returns the real context wrapped (:func:`server.vllm_hooks.processes.route_starts`). Idempotent.

    Raises:
        ImportError: the module is not there (HookTargetMissing: it does not use ``get_mp_context``).
    """
    processes.route_starts(module_name, _HandOverContext)
