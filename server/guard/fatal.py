"""Engine-core side: record the fatal exception, and the step it broke, before the engine core dies (vLLM
plugin ``vlguard_fatal``).

In the engine-core process it wraps ``EngineCoreProc.run_busy_loop``: the scheduler's ``schedule()`` is
wrapped to remember which requests each step carries (the request ids vLLM's scheduler gave them), and a
fatal exception's type and message are written with the requests of the step(s) in execution to
``$VLGUARD_STATE_DIR/fatal-<pid>.json`` before vLLM reports the engine dead. The supervisor reads it to
label the death (``deepstack``, ``exception``) and to charge the quarantine only with the requests that
could have caused it (vLLM itself only tells the API process "engine dead").

The supervisor gives each engine it builds a directory of its own (``VLGUARD_STATE_DIR`` is set before
the build and inherited by the engine-core process), so a record always belongs to one engine.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
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
        step_requests: engine-side request ids (``<request id>-<suffix>``) of the step(s) being executed.
        new_requests: those of them that were scheduled for the first time in that step.
    """

    type: str
    message: str
    step_requests: list[str] = field(default_factory=list)
    new_requests: list[str] = field(default_factory=list)

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
        )
    return None


def _remember_steps(scheduler: Any, depth: int) -> collections.deque[tuple[list[str], list[str]]]:
    """Wrap ``scheduler.schedule`` (this instance only) to keep the request ids of the last ``depth``
    steps: ``(all scheduled, newly scheduled)``. Costs a list of the step's ids per step."""
    steps: collections.deque[tuple[list[str], list[str]]] = collections.deque(maxlen=depth)
    original = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        scheduled = list(getattr(out, "num_scheduled_tokens", None) or {})
        new = [r.req_id for r in getattr(out, "scheduled_new_reqs", None) or []]
        steps.append((scheduled, new))
        return out

    scheduler.schedule = schedule
    return steps


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
            steps = _remember_steps(self.scheduler, max(1, getattr(self, "batch_queue_size", 1) or 1))
            try:
                return original(self)
            except Exception as exc:
                record = {
                    "type": type(exc).__name__,
                    "message": str(exc)[:2000],
                    "step_requests": sorted({r for scheduled, _ in steps for r in scheduled}),
                    "new_requests": sorted({r for _, new in steps for r in new}),
                }
                try:
                    fatal_path(os.environ[ENV], os.getpid()).write_text(json.dumps(record))
                except OSError:
                    logger.exception("vlguard: could not record the fatal error")
                raise

        EngineCoreProc.run_busy_loop = run_busy_loop
    except Exception:
        logger.exception("vlguard: fatal-error recorder not installed")
