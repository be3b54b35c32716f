"""Engine-core side: the steps in execution and whom a failure is charged to, shared by the fatal recorder
(:mod:`server.engine.fatal`) and soft recovery (:mod:`server.engine.soft`).

:func:`remember_steps` wraps one scheduler instance so that a :class:`StepLog` holds the steps scheduled and
not yet finished; :meth:`StepLog.blame` reads a failure's traceback for the request the failing code was
handling (:func:`named_requests`). Nothing here writes a record or decides a recovery.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from server.vllm_hooks import engine_core


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

    def log_schedule(schedule: Callable[..., Any]) -> Callable[..., Any]:
        def schedule_step(*args: Any, **kwargs: Any) -> Any:
            try:
                out = schedule(*args, **kwargs)
            except Exception:
                log.failed_in_schedule = True
                raise
            scheduled, new = engine_core.step_ids(out)
            log.steps.append((id(out), scheduled, new))
            return out

        return schedule_step

    def log_update(update: Callable[..., Any]) -> Callable[..., Any]:
        def update_from_output(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = update(scheduler_output, *args, **kwargs)  # raises: the step stays charged
            for entry in log.steps:
                if entry[0] == id(scheduler_output):
                    log.steps.remove(entry)
                    if log.on_step_done is not None and entry[1]:
                        log.on_step_done(entry[1])
                    break
            return result

        return update_from_output

    engine_core.watch_scheduler_steps(scheduler, log_schedule, log_update)
    return log
