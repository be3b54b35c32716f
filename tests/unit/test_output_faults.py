"""server.guard.output_faults on a stand-in of vLLM's output processor: a request whose output processing
raises gets the fault in its own queue; the batch's other outputs are processed, and stop-string aborts
of the ones before it are kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from server.guard.output_faults import OutputProcessingFault, confine, output_fault


@dataclass
class EngineCoreOutput:
    request_id: str
    finished: bool = False


EngineCoreOutput.__module__ = "vllm.v1.engine"


@dataclass
class Queue:
    items: list[Any] = field(default_factory=list)

    def put(self, item: Any) -> None:
        self.items.append(item)


@dataclass
class State:
    queue: Queue = field(default_factory=Queue)


@dataclass
class Result:
    reqs_to_abort: list[str]


class Processor:
    """Processes outputs in order like vLLM's loop; ``stop`` requests meet a stop string (freed, and to be
    aborted in the engine); ``bad`` raises while its output is processed."""

    def __init__(self, ids: list[str], bad: set[str], stop: set[str]) -> None:
        self.request_states = {rid: State() for rid in ids}
        self.bad, self.stop = bad, stop
        self.processed: list[str] = []

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput], *args: Any) -> Result:
        aborts = []
        for engine_core_output in engine_core_outputs:
            self._detokenize(engine_core_output)
            self.processed.append(engine_core_output.request_id)
            if engine_core_output.request_id in self.stop:
                del self.request_states[engine_core_output.request_id]
                aborts.append(engine_core_output.request_id)
        return Result(aborts)

    def _detokenize(self, out: EngineCoreOutput) -> None:
        if out.request_id in self.bad:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def test_only_the_faulting_request_is_cut_and_the_batch_goes_on() -> None:
    proc = Processor(["a", "s", "bad", "c"], bad={"bad"}, stop={"s"})
    confine(proc)
    result = proc.process_outputs([EngineCoreOutput(r) for r in ("a", "s", "bad", "c")], 0.0, None)
    assert proc.processed == ["a", "s", "c"]
    assert sorted(result.reqs_to_abort) == ["s"]  # the stop string met before the fault still aborts
    [fault] = proc.request_states["bad"].queue.items
    assert isinstance(fault, OutputProcessingFault) and isinstance(fault.__cause__, UnicodeDecodeError)
    assert proc.request_states["a"].queue.items == [] and proc.request_states["c"].queue.items == []
    # Its later outputs (it is being aborted) are dropped, not processed again.
    proc.process_outputs([EngineCoreOutput("bad"), EngineCoreOutput("a")], 0.0, None)
    assert proc.processed[-1:] == ["a"] and len(proc.request_states["bad"].queue.items) == 1


def test_a_fault_that_names_no_request_is_vllms_to_handle() -> None:
    proc = Processor(["a"], bad=set(), stop=set())

    def broken(outputs: list[EngineCoreOutput], *args: Any) -> Result:
        raise RuntimeError("stats broke")

    proc.process_outputs = broken  # type: ignore[method-assign]
    confine(proc)
    with pytest.raises(RuntimeError, match="stats broke"):
        proc.process_outputs([EngineCoreOutput("a")], 0.0, None)


def test_the_fault_is_found_behind_vllms_wrapper() -> None:
    fault = OutputProcessingFault("x")
    try:
        try:
            raise fault
        except OutputProcessingFault as inner:
            raise RuntimeError("EngineGenerateError") from inner
    except RuntimeError as outer:
        assert output_fault(outer) is fault
    assert output_fault(ValueError("other")) is None
