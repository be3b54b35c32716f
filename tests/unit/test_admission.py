"""#65 unit: admission under load against a fake engine's figures and a fake clock (server.guard.load,
server.api.overload): it admits while a request can start in time, refuses when it cannot, and admits again
once the queue drains."""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import pytest

from server.api.overload import AdmissionGate, QueueCaps
from server.guard.load import EngineLoad, Queue


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class State:
    """vLLM's RequestState, as far as the measure reads it."""

    prompt_len: int
    is_prefilling: bool = True


@dataclass
class Output:
    """vLLM's EngineCoreOutput, as far as the measure reads it."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=lambda: [7])
    finish_reason: Any = None


class FakeEngine:
    """An engine of ``slots`` running requests; each step runs every running request one token, a
    request finishes after ``tokens``, and a waiting request starts when a slot is free."""

    def __init__(self, load: EngineLoad, slots: int = 4, tokens: int = 10) -> None:
        self.load, self.slots, self.tokens = load, slots, tokens
        self.request_states: dict[str, State] = {}
        self.made: dict[str, int] = {}
        self.seq = 0

    def add(self, prompt_len: int = 100) -> str:
        self.seq += 1
        rid = f"r{self.seq}"
        self.request_states[rid] = State(prompt_len)
        return rid

    def step(self) -> None:
        running = [r for r, s in self.request_states.items() if not s.is_prefilling]
        starting = [r for r, s in self.request_states.items() if s.is_prefilling][: self.slots - len(running)]
        outputs = []
        for rid in running + starting:
            self.made[rid] = self.made.get(rid, 0) + 1
            done = self.made[rid] >= self.tokens
            outputs.append(Output(rid, finish_reason="length" if done else None))
        self.load.observe(outputs, self.request_states)  # before vLLM processes them, as attached
        for output in outputs:
            self.request_states[output.request_id].is_prefilling = False
            if output.finish_reason is not None:
                del self.request_states[output.request_id]


def engine(slots: int = 4, tokens: int = 10) -> tuple[Clock, EngineLoad, FakeEngine]:
    clock = Clock()
    load = EngineLoad(clock)
    fake = FakeEngine(load, slots, tokens)
    load._processor = fake  # what attach() keeps: the engine's OutputProcessor
    return clock, load, fake


def run(clock: Clock, fake: FakeEngine, steps: int, step_s: float = 0.1) -> None:
    for _ in range(steps):
        clock.now += step_s
        fake.step()


def queued(clock: Clock, fake: FakeEngine, waiting: int) -> None:
    """A measured rate (8 requests run for 3 s), then ``waiting`` more behind the 4 running after one step."""
    for _ in range(8):
        fake.add()
    run(clock, fake, 30)
    for _ in range(waiting + 4):
        fake.add()
    run(clock, fake, 1)


def test_an_idle_engine_admits_and_expects_no_wait() -> None:
    _, load, _ = engine()
    gate = AdmissionGate(load, max_queue_wait_s=5, client_share=0.25)
    assert load.expected_wait() == 0.0
    assert gate.refusal() is None
    assert not gate.saturated()


def test_the_expected_wait_is_the_queue_over_the_rate_requests_start() -> None:
    clock, load, fake = engine(slots=4, tokens=10)  # a request runs 1 s: 4 start a second in steady state
    for _ in range(40):
        fake.add()
    run(clock, fake, 100)  # 10 s: the steady state, 40 started
    assert load.queue() == Queue(0, 0, 0)
    for _ in range(20):  # 20 now wait behind 4 running
        fake.add()
    run(clock, fake, 1)
    queue = load.queue()
    assert queue.waiting == 16 and queue.queued_tokens == 1600 and queue.unfinished == 20
    requests_s, tokens_s = load.start_rate()
    assert requests_s == pytest.approx(4.0, rel=0.15)
    assert tokens_s == pytest.approx(400.0, rel=0.15)
    assert load.expected_wait() == pytest.approx(16 / requests_s)
    assert load.service_s() == pytest.approx(0.9)  # first token to the last of 10, one step each


def test_requests_that_fit_the_free_batch_slots_expect_no_wait_whatever_rate_was_seen() -> None:
    """An engine that had little to do shows a start rate that is its arrivals' (one a few seconds), not
    what it can do: four arriving at once to an idle batch of four start at the next step. A fifth waits
    for the rate. With two API processes each counts on half the batch."""
    clock, load, fake = engine(slots=4, tokens=10)
    load._batch = 4  # what attach() keeps: the engine's max_num_seqs
    for _ in range(4):  # one request every 5 s: a rate of 0.2 a second
        fake.add()
        run(clock, fake, 50)
    for _ in range(4):
        fake.add()
    assert load.queue() == Queue(4, 400, 4)
    assert load.expected_wait() == 0.0
    fake.add()
    assert load.expected_wait() > 5.0
    load.processes = 2
    fake.request_states.popitem()
    assert load.expected_wait() > 5.0  # 4 waiting, 2 free slots in this process's share


def test_requests_admitted_but_not_yet_in_the_engine_count_as_waiting() -> None:
    """A burst arrives faster than its bodies reach the engine (read, parsed, images decoded): the engine's
    queue alone showed none of it, and the whole burst was admitted (measured: half of the admitted callers
    at 5x capacity gave up). The requests admitted at the door and not yet in the engine wait too."""
    clock, load, fake = engine(slots=4, tokens=10)
    gate = AdmissionGate(load, max_queue_wait_s=2.0, client_share=0.25)
    for _ in range(8):
        fake.add()
    run(clock, fake, 30)  # a rate is measured (about 4 a second)
    admitted = 0
    for _ in range(60):  # 60 arrive before any reaches the engine
        if gate.refusal() is None:
            gate.inside += 1
            admitted += 1
    assert 6 <= admitted <= 12, admitted
    gate.inside += 1  # one more, decided after its body (counted already): not ahead of itself
    assert gate.refusal(counted=True) is not None
    gate.inside = 0  # they all reached the engine and ended: admitted again
    assert gate.refusal() is None


def test_the_gate_refuses_while_the_wait_is_past_the_bound_and_admits_once_the_queue_drains() -> None:
    clock, load, fake = engine(slots=4, tokens=10)
    gate = AdmissionGate(load, max_queue_wait_s=2.0, client_share=0.25)
    for _ in range(8):
        fake.add()
    run(clock, fake, 30)  # a rate is measured
    admitted = refused = 0
    for _ in range(60):  # 60 arrive at once: about 2 s of the queue is admitted
        if gate.refusal() is None:
            fake.add()
            admitted += 1
        else:
            refused += 1
    assert 6 <= admitted <= 12, admitted
    no = gate.refusal()
    assert no is not None and no.status == HTTPStatus.SERVICE_UNAVAILABLE and no.reason == "saturated"
    assert 1 <= no.retry_after_s <= 60 and "limit 2 s" in no.message
    assert gate.saturated()
    run(clock, fake, 40)  # drained
    assert gate.refusal() is None and not gate.saturated()


def test_a_stalled_engine_is_refused_once_its_queue_waited_past_the_bound() -> None:
    clock, load, fake = engine()
    gate = AdmissionGate(load, max_queue_wait_s=2.0, client_share=0.25)
    for _ in range(10):  # a burst on a new engine: nothing started yet, admitted
        assert gate.refusal() is None
        fake.add()
    clock.now += 1.0
    assert gate.refusal() is None  # waiting 1 s, nothing started: still within the bound
    clock.now += 1.5
    no = gate.refusal()
    assert no is not None and no.reason == "saturated"


def test_a_deadline_shorter_than_wait_and_service_is_refused() -> None:
    clock, load, fake = engine(slots=4, tokens=10)
    gate = AdmissionGate(load, max_queue_wait_s=30.0, client_share=0.25)
    queued(clock, fake, waiting=8)
    wait = load.expected_wait()
    assert gate.refusal(timeout_s=wait + load.service_s() + 1) is None
    no = gate.refusal(timeout_s=wait)
    assert no is not None and no.reason == "deadline" and "X-Request-Timeout" in no.message


def test_a_client_over_its_share_is_refused_while_others_wait_and_never_alone() -> None:
    clock, load, fake = engine(slots=4, tokens=10)
    gate = AdmissionGate(load, max_queue_wait_s=30.0, client_share=0.25)
    queued(clock, fake, waiting=12)  # 16 unfinished
    assert gate.refusal("addr:a", held=15, clients=1) is None  # alone: no one to be fair to
    no = gate.refusal("addr:a", held=9, clients=2)  # two clients: each may hold half of what is admitted
    assert no is not None and no.status == HTTPStatus.TOO_MANY_REQUESTS and no.reason == "client_share"
    assert gate.refusal("addr:b", held=1, clients=2) is None
    assert gate.refusal("", held=0, clients=2) is None  # no identity: not counted


def test_the_queue_caps_mean_what_vllm_0_32_means() -> None:
    _clock, load, fake = engine(slots=4, tokens=10)
    gate = AdmissionGate(load, max_queue_wait_s=0, client_share=0.25, caps=QueueCaps.of(6, 250, processes=1))
    for _ in range(4):
        fake.add(prompt_len=10)
    assert gate.refusal(sequences=2) is None  # 4 + 2 <= 6
    no = gate.refusal(sequences=3)
    assert no is not None and no.reason == "queued_reqs" and no.status == HTTPStatus.SERVICE_UNAVAILABLE
    fake.request_states.clear()
    fake.add(prompt_len=200)
    assert gate.refusal() is None  # 200 prompt tokens in prefill < 250
    fake.add(prompt_len=50)
    no = gate.refusal()  # 250 >= 250
    assert no is not None and no.reason == "queued_tokens"
    assert QueueCaps.of(7, None, processes=2) == QueueCaps(4, None)  # each API process its share


def test_an_aborted_request_counts_its_tokens_as_wasted() -> None:
    from server.metrics import definitions as m

    clock, _load, fake = engine(slots=4, tokens=100)
    before = m.ABORTED_TOKENS._value.get()
    rid = fake.add()
    run(clock, fake, 5)  # 5 tokens made
    del fake.request_states[rid]  # the caller went: vLLM aborted it
    run(clock, fake, 11)  # the next sweep
    assert m.ABORTED_TOKENS._value.get() - before == 5
