"""Soft recovery's engine-core side without an engine: when a fault is absorbed or escalates, the record,
and the order of what absorbing does (the record exists before any request hears of the fault)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from server.engine import protocol, soft
from server.engine.protocol import EngineSettings, read_soft_faults
from server.engine.soft import SoftPolicy, device_poisoned
from server.engine.step_log import remember_steps
from server.vllm_hooks import engine_core
from tests.helpers import ManualClock


@pytest.mark.parametrize(
    "message",
    [
        "Worker failed with error 'CUDA error: an illegal memory access was encountered'",
        "CUDA error: device-side assert triggered",
        "CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx",
        "NCCL error: unhandled cuda error",
    ],
)
def test_device_errors_escalate(message: str) -> None:
    assert device_poisoned(RuntimeError(message))
    assert SoftPolicy().escalation(RuntimeError(message), ["a-1"]) == "device error"


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("Requested more deepstack tokens than available in buffer"),
        RuntimeError("Worker failed with error 'vlguard test fault: poison request reached the model'"),
        AssertionError("encoder cache miss"),
        RuntimeError("CPU out of memory: tried to allocate 2.00 GiB"),
    ],
)
def test_step_exceptions_are_absorbed(exc: Exception) -> None:
    assert not device_poisoned(exc)
    assert SoftPolicy().escalation(exc, ["a-1"]) is None


def test_off_escalates_everything() -> None:
    assert SoftPolicy(enabled=False).escalation(ValueError("x"), []) == "soft recovery is off"


def test_a_new_fault_in_the_first_step_of_the_carried_requests_escalates_unless_the_suspect_is_in_it() -> None:
    policy = SoftPolicy()
    policy.absorbed([], cut=[])  # a fault that cut nothing leaves nothing on watch
    assert policy.escalation(ValueError("x"), ["any-1"]) is None
    policy.absorbed(["poison-0000aaaa"], cut=["poison-0000aaaa", "ok-0000bbbb"])
    # The poison's replay (a new engine-side suffix) fails again beside its carried neighbour: absorbed.
    assert policy.escalation(ValueError("x"), ["poison-1111cccc", "ok-1111dddd"]) is None
    # A new request's own first step may fail (its input), carried requests not in it: absorbed.
    assert policy.escalation(ValueError("x"), ["new-2222eeee"]) is None
    # The carried requests' step fails without the poison: the recovery left the engine broken.
    assert policy.escalation(ValueError("x"), ["ok-2222dddd", "new-2222eeee"]) == (
        "a new fault in the first step of the requests carried over from a soft recovery"
    )
    policy.step_passed(["new-2222eeee"])  # a step without them proves nothing
    assert policy.escalation(ValueError("x"), ["ok-3333dddd"]) is not None
    policy.step_passed(["ok-3333dddd"])
    assert policy.escalation(ValueError("x"), ["ok-4444dddd"]) is None


def test_more_than_max_uncharged_recoveries_in_the_window_escalates() -> None:
    clock = ManualClock(100.0)
    policy = SoftPolicy(max_recoveries=2, window_s=60, clock=clock)
    for _ in range(2):
        assert policy.escalation(ValueError("x"), []) is None
        policy.absorbed([], cut=["a-1"])
        policy.step_passed(["a-2"])
    assert policy.escalation(ValueError("x"), []) == "2 soft recoveries within 60 s"
    clock.now += 61
    assert policy.escalation(ValueError("x"), []) is None


def test_faults_charged_to_requests_do_not_spend_the_engine_budget() -> None:
    """#33: a deterministic poison (or a client varying one) is the quarantine's and the client budget's
    business; rebuilding cannot help it, so its faults never escalate by count."""
    policy = SoftPolicy(max_recoveries=2, window_s=60, clock=ManualClock(100.0))
    for i in range(10):
        assert policy.escalation(ValueError("x"), [f"poison{i}-1"]) is None
        policy.absorbed([f"poison{i}-1"], cut=[f"poison{i}-1"])
        policy.step_passed([f"poison{i}-2"])
    assert policy.escalation(ValueError("x"), []) is None  # the budget is still whole


def test_faults_charged_to_a_whole_step_still_spend_the_engine_budget() -> None:
    """An engine that fails every step of several requests (each charged, none alone) must escalate."""
    policy = SoftPolicy(max_recoveries=2, window_s=60, clock=ManualClock(100.0))
    for i in range(2):
        assert policy.escalation(ValueError("x"), [f"a{i}-1", f"b{i}-1"]) is None
        policy.absorbed([f"a{i}-1", f"b{i}-1"], cut=[f"a{i}-1", f"b{i}-1"])
        policy.step_passed([f"a{i}-2", f"b{i}-2"])
    assert policy.escalation(ValueError("x"), ["c-1", "d-1"]) == "2 soft recoveries within 60 s"


def test_only_a_request_handed_to_the_failing_code_is_named() -> None:
    """A loop variable outlives its loop: an exception raised after the loop must not name the loop's
    last request (found in review)."""
    from server.engine.step_log import named_requests

    def helper(request: Request) -> None:
        raise ValueError("in the request's own helper")

    def after_the_loop() -> None:
        for request in [Request("a-1"), Request("innocent-2")]:
            assert request.request_id
        raise ValueError("bookkeeping after the loop")

    with pytest.raises(ValueError) as caught:
        helper(Request("poison-3"))
    assert named_requests(caught.value) == ["poison-3"]
    with pytest.raises(ValueError) as caught:
        after_the_loop()
    assert named_requests(caught.value) == []


def test_policy_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(protocol.SOFT_RECOVERY_ENV, "off")
    monkeypatch.setenv(protocol.SOFT_RECOVERY_MAX_ENV, "3")
    monkeypatch.setenv(protocol.SOFT_RECOVERY_WINDOW_ENV, "30.5")
    policy = SoftPolicy.from_settings(EngineSettings.from_environ())
    assert (policy.enabled, policy.max_recoveries, policy.window_s) == (False, 3, 30.5)


def test_records_are_read_once_in_order_and_bad_files_skipped(tmp_path: Path) -> None:
    def write(name: str, **fields: Any) -> None:
        base = {"type": "ValueError", "message": "m", "step_requests": [], "new_requests": [], "cut": [],
                "recovery_s": 0.01}  # fmt: skip
        (tmp_path / name).write_text(json.dumps({**base, **fields}))

    write("soft-7-10.json", cut=["c-1"])
    write("soft-7-2.json", cut=["b-1"])
    (tmp_path / "soft-7-3.json").write_text("{not json")
    (tmp_path / "fatal-7.json").write_text("{}")
    found = read_soft_faults(tmp_path)
    assert [(name, r.cut) for name, r in found] == [("soft-7-2.json", ["b-1"]), ("soft-7-10.json", ["c-1"])]
    assert read_soft_faults(tmp_path, skip=[name for name, _ in found]) == []


class FakeRequest:
    def __init__(self, request_id: str) -> None:
        self.request_id, self.client_index = request_id, 0


class FakeScheduler:
    """What soft recovery touches on vLLM's scheduler; ``step`` names the requests the next step schedules
    (default: all)."""

    def __init__(self, events: list[str], *ids: str) -> None:
        self.events = events
        self.requests = {rid: FakeRequest(rid) for rid in ids}
        self.running = list(self.requests.values())
        self.waiting: list[FakeRequest] = []
        self.step: list[str] | None = None

    def schedule(self) -> Any:
        ids = self.step if self.step is not None else list(self.requests)
        return type("Out", (), {"num_scheduled_tokens": dict.fromkeys(ids, 1), "scheduled_new_reqs": []})()

    def update_from_output(self, out: Any, model_output: Any) -> dict[int, Any]:
        return {}

    def finish_requests(self, ids: list[str], status: Any) -> list[tuple[str, int]]:
        self.events.append("finish")
        self.running = [r for r in self.running if r.request_id not in ids]
        for rid in ids:
            del self.requests[rid]
        return [(rid, 0) for rid in ids]

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset_prefix_cache")
        return True


class FakeCore:
    """The parts of vLLM's ``EngineCoreProc`` that soft recovery uses; its step raises in the model while
    ``fail`` is set, else processes its output."""

    def __init__(self, events: list[str], tmp_path: Path, *ids: str) -> None:
        self.events = events
        self.tmp_path = tmp_path
        self.scheduler = FakeScheduler(events, *ids)
        self.model_executor = self
        self.output_queue = self
        self.batch_queue = None
        self.fail: Exception | None = ValueError("Requested more deepstack tokens than available in buffer")

    def add_request(self, request: Any, wave: int = 0) -> None:
        self.scheduler.requests[request.request_id] = request

    def step_fn(self) -> tuple[dict[int, Any], bool]:
        out = self.scheduler.schedule()
        if self.fail is not None:
            raise self.fail
        return self.scheduler.update_from_output(out, None), True

    def collective_rpc(self, method: Any, timeout: float | None = None) -> list[Any]:
        self.events.append("device_check")
        return [method(None)]

    def reset_encoder_cache(self) -> None:
        self.events.append("reset_encoder_cache")

    def reset_mm_cache(self) -> None:
        self.events.append("reset_mm_cache")

    def put_nowait(self, item: Any) -> None:
        records = sorted(p.name for p in self.tmp_path.glob("soft-*.json"))
        self.events.append(f"outputs {sorted(o.request_id for o in item[1].outputs)} after {records}")


def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *ids: str) -> tuple[FakeCore, Any, list[str]]:
    monkeypatch.setenv(protocol.STATE_DIR_ENV, str(tmp_path))
    events: list[str] = []
    core = FakeCore(events, tmp_path, *ids)
    log = remember_steps(core.scheduler, 1)
    soft.install(core, log, SoftPolicy())
    return core, log, events


def test_absorbing_resets_the_engine_then_records_then_finishes_the_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, log, events = installed(tmp_path, monkeypatch, "a-1", "b-2")
    core.scheduler.step = ["b-2"]  # the failing step holds b only; a is cut too
    assert core.step_fn() == ({}, False)
    [(name, record)] = read_soft_faults(tmp_path)
    assert events == [
        "device_check",
        "finish",
        "reset_prefix_cache",
        "reset_encoder_cache",  # not the multimodal processor cache: the guard's shadow of it stays valid
        f"outputs ['a-1', 'b-2'] after ['{name}']",
    ]
    assert (record.type, record.step_requests, record.cut) == ("ValueError", ["b-2"], ["a-1", "b-2"])
    assert log.in_execution() == ([], [])
    # The carried request a comes back (a new suffix) and its step fails without b: escalates (re-raised).
    core.scheduler.requests, core.scheduler.step = {"a-3": FakeRequest("a-3")}, None
    with pytest.raises(ValueError, match="deepstack"):
        core.step_fn()


def test_a_completed_step_of_the_carried_requests_ends_the_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, _, _ = installed(tmp_path, monkeypatch, "a-1", "b-2")
    core.scheduler.step = ["b-2"]
    core.step_fn()
    core.fail, core.scheduler.requests = None, {"a-3": FakeRequest("a-3")}
    assert core.step_fn() == ({}, True)  # a's first step after the recovery completed
    core.fail = ValueError("boom")
    assert core.step_fn() == ({}, False)  # a later fault of a's is a fault like any other: absorbed


def test_requests_freed_but_still_queued_are_cut_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # update_from_output freed a stopped request, then raised before removing it from the running list.
    core, _, _ = installed(tmp_path, monkeypatch, "a-1")
    core.scheduler.running.append(FakeRequest("done-9"))
    core.scheduler.waiting.append(FakeRequest("gone-8"))
    core.scheduler.waiting = type("Q", (list,), {"remove_requests": lambda q, rs: [q.remove(r) for r in rs]})(
        core.scheduler.waiting
    )
    assert core.step_fn() == ({}, False)
    [(_, record)] = read_soft_faults(tmp_path)
    assert record.cut == ["a-1", "done-9", "gone-8"]
    assert (core.scheduler.running, list(core.scheduler.waiting)) == ([], [])


def test_device_check_drops_a_pending_execute_model_state() -> None:
    worker = type("W", (), {"model_runner": type("R", (), {"execute_model_state": object()})()})()
    assert engine_core._synchronize_device(worker) is True
    assert worker.model_runner.execute_model_state is None


def test_pooling_models_are_left_alone(tmp_path: Path) -> None:
    core = FakeCore([], tmp_path, "a-1")
    core.is_pooling_model = True  # type: ignore[attr-defined]
    step = core.step_fn
    soft.install(core, remember_steps(core.scheduler, 1), SoftPolicy())
    assert core.step_fn == step


class Request:
    """Stands in for ``vllm.v1.request.Request`` (matched by class name and module)."""

    __module__ = "vllm.v1.request"

    def __init__(self, request_id: str) -> None:
        self.request_id, self.client_index = request_id, 0


class GrammarScheduler(FakeScheduler):
    """A scheduler whose ``schedule()`` compiles a waiting request's grammar, which raises for ``bad``."""

    def __init__(self, events: list[str], bad: str | None, *ids: str) -> None:
        super().__init__(events, *ids)
        self.bad = bad

    def schedule(self) -> Any:
        for request in [Request(rid) for rid in self.requests]:
            self._grammar(request)
        return super().schedule()

    def _grammar(self, request: Request) -> None:
        if request.request_id == self.bad:
            raise ValueError("No valid structured output parameter found")


def test_a_fault_while_scheduling_is_charged_to_the_request_it_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#33: the structured-output grammar of one request fails inside ``schedule()``: the traceback names
    it, so it alone is charged (before: nobody, and every fault of it ended in a rebuild)."""
    core, log, _ = installed(tmp_path, monkeypatch, "ok-1", "poison-2", "ok-3")
    core.fail = None
    core.scheduler = GrammarScheduler(core.events, "poison-2", "ok-1", "poison-2", "ok-3")
    log = remember_steps(core.scheduler, 1)
    policy = SoftPolicy(max_recoveries=1)
    soft.install(core, log, policy)
    assert core.step_fn() == ({}, False)
    [(_, record)] = read_soft_faults(tmp_path)
    assert (record.step_requests, record.named, record.suspects) == (["poison-2"], True, [])
    assert record.cut == ["ok-1", "ok-3", "poison-2"]
    # It comes back beside the carried innocents and fails again: absorbed again (the suspect is in it),
    # and the engine's budget of one uncharged recovery is still unspent.
    core.scheduler.requests = {rid: FakeRequest(rid) for rid in ("ok-4", "poison-5")}
    core.scheduler.bad = "poison-5"
    assert core.step_fn() == ({}, False)
    assert policy.escalation(ValueError("x"), []) is None


def test_a_fault_that_names_nobody_makes_every_request_held_a_suspect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#33: ``schedule()`` raises with no request in reach: nobody is charged, every request held is a
    suspect (they re-enter one at a time); alone in the engine, the next such fault is its own."""
    monkeypatch.setenv(protocol.STATE_DIR_ENV, str(tmp_path))
    core = FakeCore([], tmp_path, "a-1", "b-2")

    def schedule() -> Any:
        raise AssertionError("scheduler bookkeeping")

    core.scheduler.schedule = schedule  # type: ignore[method-assign]
    soft.install(core, remember_steps(core.scheduler, 1), SoftPolicy())
    assert core.step_fn() == ({}, False)
    core.scheduler.requests = {"b-3": FakeRequest("b-3")}
    assert core.step_fn() == ({}, False)
    first, second = (r for _, r in read_soft_faults(tmp_path))
    assert (first.step_requests, first.suspects, first.named) == ([], ["a-1", "b-2"], False)
    assert (second.step_requests, second.suspects) == (["b-3"], [])


def test_a_fault_while_admitting_a_request_cuts_and_charges_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception from ``EngineCore.add_request`` (outside any step) is absorbed like a step's: the
    request being added is charged and gets its ERROR finish even though the scheduler never held it."""
    core, _, events = installed(tmp_path, monkeypatch, "a-1")

    def add_request(request: Any, wave: int = 0) -> None:
        raise TypeError("request_id must be a string")

    core.add_request = add_request  # type: ignore[attr-defined]
    log = remember_steps(core.scheduler, 1)
    soft.install(core, log, SoftPolicy())
    core.add_request(Request("new-9"), 0)  # type: ignore[attr-defined]
    [(_, record)] = read_soft_faults(tmp_path)
    assert (record.step_requests, record.cut, record.named) == (["new-9"], ["a-1", "new-9"], True)
    assert events[-1].startswith("outputs ['a-1', 'new-9']")


def test_a_named_fault_of_a_carried_request_is_its_own_and_absorbed() -> None:
    """Found by the 10-minute poison benchmark: a new poison that a previous poison's recovery had cut
    (carried over before its first step) faulted in its own admission and, not yet a suspect, escalated
    to a rebuild. A fault the failing code named is that request's, carried or not."""
    policy = SoftPolicy()
    policy.absorbed(["poison1-0000aaaa"], cut=["poison1-0000aaaa", "poison2-0000bbbb", "ok-0000cccc"])
    assert policy.escalation(ValueError("x"), ["poison2-1111bbbb"], named=True) is None
    # Unnamed, the same step would read as a broken engine (the carried request fails without a suspect).
    assert policy.escalation(ValueError("x"), ["poison2-1111bbbb"]) is not None


def test_a_record_without_a_state_directory_is_refused_not_written_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside ``vlguard serve`` (no state directory) a record cannot be written: soft recovery escalates
    instead of leaving files in the working directory."""
    monkeypatch.chdir(tmp_path)
    record = protocol.SoftFault("ValueError", "m", [], [], [], 0.0)
    with pytest.raises(OSError, match="no state directory"):
        protocol.write_soft_fault("", record, 1)
    assert list(tmp_path.iterdir()) == []


def test_the_plugin_reads_only_the_state_directory_before_the_first_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM loads the plugins before the supervisor writes the policy: a stale, unparsable value left in the
    environment must not stop the start (the build overwrites it)."""
    monkeypatch.setenv(protocol.SOFT_RECOVERY_WINDOW_ENV, "abc")
    monkeypatch.setenv(protocol.STATE_DIR_ENV, "/somewhere")
    assert EngineSettings.state_dir_of() == "/somewhere"
    with pytest.raises(ValueError):
        EngineSettings.from_environ()
