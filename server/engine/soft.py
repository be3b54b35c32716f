"""Engine-core side of soft recovery: absorb an exception raised inside one engine step, keep the process.

Installed with the fatal recorder (:mod:`server.engine.fatal`, plugin ``vlguard_fatal``) in the engine-core
process, on the engine core's ``step_fn``: the step that schedules, runs the model in the worker (an
exception there comes back through the executor) and processes the output. When a step raises and
:class:`SoftPolicy` allows it, :func:`absorb`:

1. waits for the batches still in execution (pipelined scheduling) and checks the device with one
   synchronising call in every worker (a poisoned CUDA context fails it: then it escalates);
2. finishes **every** request the scheduler holds with ``FINISHED_ERROR`` (their KV blocks, encoder-cache
   entries and worker-side state are freed; the model runner drops them with the next step);
3. resets the prefix cache (no block is in use any more, so no block written in the failed step can be
   served again) and the encoder cache (scheduler and workers); the engine core's multimodal processor
   cache is kept (it holds inputs as they arrived, which no step writes; the guard's shadow of it,
   :mod:`server.guard.ipc_cache`, stays valid, and resetting it here would race vLLM's input thread);
4. writes a :class:`~server.engine.protocol.SoftFault` record (the exception, the failing step's requests,
   every request cut), then sends each cut request an ``ERROR`` finish with no tokens.

The API-side guard sees those finishes, reads the record (:mod:`server.guard.accounting`) and
carries each cut request over onto the same engine exactly as after a death: replayed when nothing was
sent, resumed from the tokens sent otherwise, charged and isolated when it was in the failing step.
The deepstack buffer, the weights, the compiled model and captured graphs are untouched.

Escalation (the exception is re-raised: the engine core dies and the guard rebuilds) is decided by
:class:`SoftPolicy`, from the :class:`~server.engine.protocol.EngineSettings` the supervisor writes before
each build.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from server.engine.protocol import EngineSettings, SoftFault, format_traceback, request_bases, write_soft_fault
from server.engine.step_log import StepLog
from server.vllm_hooks import engine_core

logger = logging.getLogger("vllm.vlguard.soft")

#: Exceptions after which the device context cannot be trusted (CUDA/ROCm runtime, cuBLAS/cuDNN, NCCL,
#: device-side asserts): matched against ``"<type>: <message>"``, case-insensitively.
DEVICE_POISON = re.compile(
    r"CUDA error|CUDA driver error|cuda runtime error|HIP error|CUBLAS_STATUS|CUDNN_STATUS|cuDNN error|"
    r"device-side assert|illegal memory access|illegal instruction|misaligned address|NCCL error|"
    r"unspecified launch failure|uncorrectable ECC|AcceleratorError",
    re.IGNORECASE,
)


def device_poisoned(exc: BaseException) -> bool:
    """Whether ``exc`` reads as a device error that poisons the context (a rebuild is needed)."""
    return bool(DEVICE_POISON.search(f"{type(exc).__name__}: {exc}"))


@dataclass
class SoftPolicy:
    """When a step's exception may be absorbed, and when it must escalate to a rebuild.

    Arguments:
        enabled: ``--guard-soft-recovery``.
        max_recoveries: ``--guard-soft-recovery-max``: soft recoveries allowed within ``window_s``.
        window_s: ``--guard-restart-window`` (seconds).
        clock: monotonic seconds.
    """

    enabled: bool = True
    max_recoveries: int = 10
    window_s: float = 600.0
    clock: Callable[[], float] = time.monotonic
    _times: collections.deque[float] = field(default_factory=collections.deque)
    #: API-side ids of the requests the last recovery cut, until a model step holding one has passed.
    _carried: set[str] = field(default_factory=set)
    #: API-side ids of the last failing step's requests (its suspects).
    _suspects: set[str] = field(default_factory=set)

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> SoftPolicy:
        """The policy the supervisor asked for this engine."""
        return cls(settings.soft_recovery, settings.soft_recovery_max, settings.soft_recovery_window)

    def escalation(self, exc: BaseException, step_requests: Iterable[str], named: bool = False) -> str | None:
        """Why this fault must escalate to a rebuild, or None to absorb it.

        The first completed step that holds requests carried over from the last recovery is its test: a
        fault in a step holding them escalates unless the step also holds a request of a step that failed
        before (a poison input failing again is the quarantine's business, not a sign that the recovery
        left the engine broken). Steps holding only other requests (new ones, whose own input may fault)
        do not count. A new poison scheduled together with carried requests escalates too: a rebuild,
        the safe side. A fault the failing code named (``named``: it was handling that request, in
        admission, scheduling or output processing) is that request's own, carried or not: it never
        escalates by this test (a client sending one varied poison a second rebuilt the engine every
        half minute before).
        """
        if not self.enabled:
            return "soft recovery is off"
        if device_poisoned(exc):
            return "device error"
        in_step = request_bases(step_requests)
        if not named and in_step & self._carried and not in_step & self._suspects:
            return "a new fault in the first step of the requests carried over from a soft recovery"
        now = self.clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_recoveries:
            return f"{len(self._times)} soft recoveries within {self.window_s:g} s"
        return None

    def absorbed(self, step_requests: Iterable[str], cut: Iterable[str], suspects: Iterable[str] = ()) -> None:
        """A fault was absorbed: the first step of what it cut is on watch (added to what an earlier
        recovery's carried requests still owe). It counts against ``max_recoveries`` unless it was charged
        to exactly one request (the failing code named it, or it was alone in its step, as a suspect on
        probation is): that fault is the request's to pay (the guard's quarantine and per-client budget),
        not the engine's health budget. A fault charged to a whole step of several requests still counts:
        an engine that fails every step must not go on forever. ``suspects`` (a
        fault that named nobody) may fail again without the engine being to blame, like charged ones."""
        charged = request_bases(step_requests)
        if len(charged) != 1:  # charged to one request (named, or alone in its step): not the engine's health
            self._times.append(self.clock())
        self._suspects |= charged | request_bases(suspects)
        self._carried |= request_bases(cut)

    def step_passed(self, step_requests: Iterable[str]) -> None:
        """A step's output was processed without error (``step_requests``: the requests it scheduled)."""
        if self._carried and request_bases(step_requests) & self._carried:
            self._carried, self._suspects = set(), set()


def absorb(
    core: Any, exc: BaseException, log: StepLog, started: float, seq: int, also_cut: Iterable[tuple[str, int]] = ()
) -> SoftFault:
    """Make the engine core trustworthy again after ``exc`` (see the module docstring, steps 1-4).

    Arguments:
        core: vLLM's ``EngineCoreProc``.
        exc: what the step raised.
        log: the steps in execution (their requests are charged).
        started: ``time.monotonic()`` when the step raised.
        seq: this engine core's soft-recovery count (names the record).
        also_cut: ``(request id, client index)`` of a request being admitted that the scheduler may not
            hold yet: it gets its ``ERROR`` finish too.

    Returns:
        The record written.

    Raises:
        Exception: the device check failed or a cache could not be reset: the caller escalates.
    """
    step_requests, new_requests = log.in_execution()
    engine_core.wait_for_batches(core)  # their results are dropped
    engine_core.synchronize_workers(core)
    cut = engine_core.finish_every_request(core)
    cut += [entry for entry in also_cut if entry[0] not in {rid for rid, _ in cut}]
    engine_core.reset_caches(core)
    record = SoftFault(
        type=type(exc).__name__,
        message=str(exc)[:2000],
        step_requests=step_requests,
        new_requests=new_requests,
        cut=sorted({rid for rid, _ in cut}),
        recovery_s=time.monotonic() - started,
        suspects=list(log.suspects),
        named=bool(log.culprits),
        traceback=format_traceback(exc),
    )
    # before the finishes: the guard reads it when one arrives
    write_soft_fault(EngineSettings.state_dir_of(), record, seq)
    log.forget()  # only now: had anything above failed, the fatal record would still charge the step
    engine_core.send_error_finishes(core, cut)
    return record


def install(core: Any, log: StepLog, policy: SoftPolicy) -> None:
    """Wrap ``core.step_fn`` and ``core.add_request`` (this instance,
    :func:`server.vllm_hooks.engine_core.guard_step_and_admission`) so that an exception raised while
    the engine core admits a request, schedules, runs the model or processes a step's output is absorbed
    where ``policy`` allows it and re-raised otherwise (the engine core then dies as before and the guard
    rebuilds). The fault is charged to the request(s) the failing code named (:meth:`StepLog.blame`).
    Not for pooling models (vLLM's output processor expects their outputs to carry a pooling result)."""
    if engine_core.is_pooling(core):
        logger.info("vlguard: soft recovery is for generating models; step faults rebuild this engine")
        return
    seq = 0

    def recover(exc: Exception, also_cut: Iterable[tuple[str, int]] = ()) -> None:
        """Absorb ``exc`` or re-raise it."""
        nonlocal seq
        started = time.monotonic()
        log.blame(exc, engine_core.held_requests(core))
        step_requests = log.in_execution()[0]
        why = policy.escalation(exc, step_requests, named=bool(log.culprits))
        if why is not None:
            logger.error("vlguard: engine step failed (%s: %s); not absorbed: %s", type(exc).__name__, exc, why)
            raise exc
        try:
            seq += 1
            record = absorb(core, exc, log, started, seq, also_cut)
        except Exception as failure:
            logger.error("vlguard: soft recovery failed (%s: %s); escalating to a rebuild",
                         type(failure).__name__, failure)  # fmt: skip
            raise exc from None
        policy.absorbed(step_requests, record.cut, record.suspects)
        logger.warning(
            "vlguard: engine step failed (%s); absorbed in %.3f s: %d request(s) cut for the guard to carry over",
            record.describe()[:300], record.recovery_s, len(record.cut),
        )  # fmt: skip

    def guard_step(step: Callable[[], Any]) -> Callable[[], Any]:
        def guarded_step() -> Any:
            try:
                return step()
            except Exception as exc:
                recover(exc)
                return {}, False

        return guarded_step

    def guard_admission(add_request: Callable[..., Any]) -> Callable[..., Any]:
        def guarded_add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return add_request(request, *args, **kwargs)
            except Exception as exc:
                recover(exc, [(request.request_id, request.client_index)])
                return None

        return guarded_add_request

    engine_core.guard_step_and_admission(core, guard_step, guard_admission)
    log.on_step_done = policy.step_passed  # only once both are wrapped (neither is, when one is missing)
