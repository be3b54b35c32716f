"""Engine-core side: record the fatal exception, and the step it broke, before the engine core dies (vLLM
plugin ``vlguard_fatal``).

In the engine-core process it wraps ``EngineCoreProc.run_busy_loop``: the scheduler's ``schedule()`` and
``update_from_output()`` are wrapped to know which steps are in execution and which requests they carry
(the request ids vLLM's scheduler gave them), and a fatal exception's type and message are written with
the requests of the step(s) in execution (none when ``schedule()`` itself raised) to
``$VLGUARD_STATE_DIR/fatal-<pid>.json`` before vLLM reports the engine dead. The supervisor reads it to
label the death (``deepstack``, ``exception``) and to charge the quarantine only with the requests that
could have caused it (vLLM itself only tells the API process "engine dead"). The same wrapper installs
soft recovery (:mod:`server.guard.soft`), which absorbs most step faults before they get here.

The supervisor gives each engine it builds a directory of its own (``VLGUARD_STATE_DIR`` is set before
the build and inherited by the engine-core process), so a record always belongs to one engine.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ENV = "VLGUARD_STATE_DIR"
logger = logging.getLogger("vllm.vlguard.fatal")
_registered = False


@dataclass(frozen=True)
class FatalRecord:
    """What an engine core recorded before dying.

    Attributes:
        type: the exception's class name.
        message: its message (at most 2000 characters).
        step_requests: engine-side request ids (``<request id>-<suffix>``) charged with the fault: the
            request(s) the failing code was handling when it names them (:func:`named_requests`), else
            those of the step(s) being executed.
        new_requests: those of them that were scheduled for the first time in that step.
        suspects: when nothing could be charged (a fault in ``schedule()`` or outside a step that named no
            request), every request the scheduler held: they re-enter one at a time on probation, so the
            next fault names the culprit.
    """

    type: str
    message: str
    step_requests: list[str] = field(default_factory=list)
    new_requests: list[str] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)
    #: whether ``step_requests`` were named by the failing code itself (not the whole step's requests).
    named: bool = False

    def describe(self) -> str:
        """``"<Type>: <message>"``."""
        return f"{self.type}: {self.message}"


def fatal_path(state_dir: str | Path, pid: int) -> Path:
    """Where the engine core with ``pid`` records its fatal error."""
    return Path(state_dir) / f"fatal-{pid}.json"


def read_fatal(state_dir: str | Path) -> FatalRecord | None:
    """The record an engine core wrote in ``state_dir`` (an engine's own directory), or None."""
    for path in sorted(Path(state_dir).glob("fatal-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return FatalRecord(
            type=str(data.get("type")),
            message=str(data.get("message")),
            step_requests=[str(r) for r in data.get("step_requests") or []],
            new_requests=[str(r) for r in data.get("new_requests") or []],
            suspects=[str(r) for r in data.get("suspects") or []],
            named=bool(data.get("named")),
        )
    return None


def _is_vllm_request(value: Any) -> bool:
    """Whether ``value`` is an engine-core request (``vllm.v1.request.Request``; by name, so this module
    imports nothing of vLLM)."""
    cls = type(value)
    return (
        cls.__name__ == "Request"
        and cls.__module__.startswith("vllm.")
        and isinstance(getattr(value, "request_id", None), str)
    )


def innermost_frames(exc: BaseException) -> list[FrameType]:
    """The frames of ``exc``'s traceback, innermost (where it was raised) first."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]


def named_requests(exc: BaseException) -> list[str]:
    """The engine-side ids of the request(s) the failing code was handling when ``exc`` was raised.

    Reads the traceback, innermost frame first (then the exceptions it was raised from): the first frame
    of a function that was handed a vLLM ``Request`` as an argument (``add_request(request)``,
    ``_create_grammar(request)`` in the grammar compiler's thread, the per-request helpers of
    ``schedule()`` and ``update_from_output()``) names it. Only arguments count: a loop variable outlives
    its loop, so an exception raised after the loop would name the loop's last request, an innocent.
    Works on every vLLM version without naming its functions. A fault raised in another process (a model
    runner's, reported through the executor) carries no such frame: the caller then charges the step.

    Returns:
        Sorted request ids; empty when no frame holds a request.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame in innermost_frames(current):
            code = frame.f_code
            arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            values = [frame.f_locals.get(name) for name in arguments]
            found = {str(v.request_id) for v in values if v is not None and _is_vllm_request(v)}
            if found:
                return sorted(found)
        current = current.__cause__ or current.__context__
    return []


@dataclass
class StepLog:
    """The steps an engine core has scheduled and not yet finished, as ``(scheduler output id, all
    scheduled request ids, newly scheduled ids)``, oldest first; ``failed_in_schedule`` when the last
    ``schedule()`` itself raised (no request is known to have caused that)."""

    steps: collections.deque[tuple[int, list[str], list[str]]]
    failed_in_schedule: bool = False
    #: called with a step's scheduled request ids once its output was processed without error.
    on_step_done: Callable[[list[str]], None] | None = None
    #: the request(s) the last failure named (:meth:`blame`).
    culprits: list[str] = field(default_factory=list)
    #: when the last failure named nobody and no step was executing: every request the scheduler held.
    suspects: list[str] = field(default_factory=list)

    def blame(self, exc: BaseException, holding: list[str]) -> None:
        """Decide whom the failure ``exc`` is charged to, before :meth:`in_execution` is read.

        Arguments:
            exc: what was raised (in ``schedule()``, a model step, ``update_from_output()``, ``add_request``).
            holding: engine-side ids of every request the scheduler holds now.

        The request(s) the failing code was handling when the traceback names them; else, for a failure
        outside any executing step, the only request held if there is just one, or no one (every request
        held becomes a suspect, to re-enter one at a time).
        """
        self.culprits = named_requests(exc)
        self.suspects = []
        if not self.culprits and (self.failed_in_schedule or not self.steps):
            if len(holding) == 1:
                self.culprits = list(holding)
            else:
                self.suspects = sorted(holding)

    def forget(self) -> None:
        """The failure was absorbed: nothing is in execution or blamed any more."""
        self.steps.clear()
        self.failed_in_schedule = False
        self.culprits, self.suspects = [], []

    def in_execution(self) -> tuple[list[str], list[str]]:
        """``(step requests, new requests)`` to charge: the request(s) the failure named (:meth:`blame`),
        else those of the steps that were executing (none when the failure came from ``schedule()``)."""
        new = {r for _, _, new in self.steps for r in new}
        if self.culprits:
            return sorted(self.culprits), sorted(new & set(self.culprits))
        if self.failed_in_schedule:
            return [], []
        return sorted({r for _, scheduled, _ in self.steps for r in scheduled}), sorted(new)


def remember_steps(scheduler: Any, depth: int) -> StepLog:
    """Wrap ``scheduler.schedule`` and ``scheduler.update_from_output`` (this instance only) so the log
    holds the steps in execution: a step enters when scheduled and leaves when its output was processed
    without error. An exception from ``schedule()`` itself, or from anything outside a step, then charges
    no finished step's requests. Costs a list of the step's ids per step.

    Arguments:
        scheduler: vLLM's scheduler instance in the engine-core process.
        depth: steps in execution at once (1, or the batch queue's size); the log keeps two more.
    """
    log = StepLog(collections.deque(maxlen=depth + 2))
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def schedule_step(*args: Any, **kwargs: Any) -> Any:
        try:
            out = schedule(*args, **kwargs)
        except Exception:
            log.failed_in_schedule = True
            raise
        scheduled = list(getattr(out, "num_scheduled_tokens", None) or {})
        new = [r.req_id for r in getattr(out, "scheduled_new_reqs", None) or []]
        log.steps.append((id(out), scheduled, new))
        return out

    def update_from_output(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        result = update(scheduler_output, *args, **kwargs)  # raises: the step stays charged
        for entry in log.steps:
            if entry[0] == id(scheduler_output):
                log.steps.remove(entry)
                if log.on_step_done is not None and entry[1]:
                    log.on_step_done(entry[1])
                break
        return result

    scheduler.schedule, scheduler.update_from_output = schedule_step, update_from_output
    return log


def register() -> None:
    """Plugin entry point. Idempotent; never raises into vLLM."""
    global _registered
    if _registered or not os.environ.get(ENV):
        return
    _registered = True
    try:
        from vllm.v1.engine.core import EngineCoreProc

        original = EngineCoreProc.run_busy_loop

        def run_busy_loop(self: Any) -> Any:
            # Steps in execution at once: 1, or the batch queue's size (pipelined scheduling).
            log = remember_steps(self.scheduler, max(1, getattr(self, "batch_queue_size", 1) or 1))
            try:
                from server.guard import soft

                soft.install(self, log, soft.SoftPolicy.from_env())
            except Exception:
                logger.exception("vlguard: soft recovery not installed; every step fault rebuilds the engine")
            try:
                return original(self)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    log.blame(exc, list(self.scheduler.requests))
                step_requests, new_requests = log.in_execution()
                record = {
                    "type": type(exc).__name__,
                    "message": str(exc)[:2000],
                    "step_requests": step_requests,
                    "new_requests": new_requests,
                    "suspects": log.suspects,
                    "named": bool(log.culprits),
                }
                try:
                    fatal_path(os.environ[ENV], os.getpid()).write_text(json.dumps(record))
                except OSError:
                    logger.exception("vlguard: could not record the fatal error")
                raise

        EngineCoreProc.run_busy_loop = run_busy_loop
    except Exception:
        logger.exception("vlguard: fatal-error recorder not installed")
