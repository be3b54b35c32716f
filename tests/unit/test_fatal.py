"""The engine-core step log behind the fatal record (server.engine.step_log.remember_steps), on a stub
scheduler: only steps in execution are charged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from server.engine.step_log import remember_steps


@dataclass
class Req:
    req_id: str


@dataclass
class Out:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[Req] = field(default_factory=list)


class StubScheduler:
    def __init__(self) -> None:
        self.next: list[Out] = []
        self.raise_in: str | None = None

    def schedule(self) -> Out:
        if self.raise_in == "schedule":
            raise AssertionError("scheduler bookkeeping")
        return self.next.pop(0)

    def update_from_output(self, out: Out, model_output: Any) -> dict[str, Any]:
        if self.raise_in == "update":
            raise ValueError("bad output")
        return {}


def test_a_finished_step_is_not_charged_the_executing_one_is() -> None:
    sched = StubScheduler()
    log = remember_steps(sched, depth=1)
    sched.next = [Out({"a-1": 5, "b-2": 1}, [Req("a-1")]), Out({"b-2": 1, "c-3": 9}, [Req("c-3")])]
    first = sched.schedule()
    sched.update_from_output(first, None)  # step 1 finished
    sched.schedule()  # step 2 executing when the engine core dies
    assert log.in_execution() == (["b-2", "c-3"], ["c-3"])


def test_pipelined_steps_leave_in_any_order() -> None:
    sched = StubScheduler()
    log = remember_steps(sched, depth=2)
    sched.next = [Out({"a-1": 1}), Out({"b-2": 1})]
    one, two = sched.schedule(), sched.schedule()
    sched.update_from_output(two, None)
    assert log.in_execution() == (["a-1"], [])
    sched.update_from_output(one, None)
    assert log.in_execution() == ([], [])


def test_an_exception_in_schedule_charges_nobody() -> None:
    sched = StubScheduler()
    log = remember_steps(sched, depth=2)
    sched.next = [Out({"a-1": 1})]
    sched.schedule()  # still executing (pipelined)
    sched.raise_in = "schedule"
    with pytest.raises(AssertionError):
        sched.schedule()
    assert log.in_execution() == ([], [])


def test_an_exception_processing_a_step_charges_that_step() -> None:
    sched = StubScheduler()
    log = remember_steps(sched, depth=1)
    sched.next = [Out({"a-1": 1}, [Req("a-1")])]
    out = sched.schedule()
    sched.raise_in = "update"
    with pytest.raises(ValueError):
        sched.update_from_output(out, None)
    assert log.in_execution() == (["a-1"], ["a-1"])
