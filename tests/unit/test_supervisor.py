"""The supervisor and the engine client on a fake engine: restart budget, backoff, give-up, hold and hold
timeout, replay and resume, probation and quarantine across deaths, hang detection, the ready probe.

Deterministic: the fake engine dies, hangs or blocks its build when the test says so, the clock is the
test's, the restart backoff is recorded instead of slept, and every wait is on a state or an event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from server.guard.clients import ClientBudget, ClientRefusedError, client_key, current_client
from server.guard.errors import EngineUnavailableError, QuarantinedRequestError
from server.guard.supervisor import EngineState
from server.guard.watchdog import DeathCause
from tests.fakes import FakeEngineFactory, GuardHarness, greedy_tokens
from tests.helpers import ManualClock

POISON = 666
WAIT_S = 10  # bound on any single wait in this module; nothing here should take more than milliseconds


class Guard(GuardHarness):
    def __init__(self, factory: FakeEngineFactory, **settings: Any) -> None:
        super().__init__(factory, wait_s=WAIT_S, **settings)


@pytest.fixture
async def make_guard() -> AsyncIterator[Callable[..., Any]]:
    guards: list[Guard] = []

    async def make(factory: FakeEngineFactory | None = None, **settings: Any) -> Guard:
        g = Guard(factory or FakeEngineFactory(poison=[POISON]), **settings)
        await g.sup.start()
        guards.append(g)
        return g

    yield make
    for g in guards:
        await g.sup.shutdown()


async def test_start_probes_and_is_ready(make_guard: Callable[..., Any]) -> None:
    g = await make_guard()
    assert g.sup.state is EngineState.READY and g.sup.generation == 1
    engine = g.factory.current
    assert engine.requests[0].startswith("vlguard-probe-") and engine.mm_cache_resets == 1
    # token ids, not text: text would be tokenized on the event loop beside vLLM's tokenizer thread
    assert engine.inputs[engine.requests[0]] == {"prompt_token_ids": [0]}
    assert g.sup.is_ready()
    assert await g.collect([1, 2, 3]) == greedy_tokens([1, 2, 3], 4)


async def test_ready_needs_a_recent_probe_or_output(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(ready_probe_interval=10)
    g.clock.now += 31  # three probe intervals without output
    assert not g.sup.is_ready()
    await g.sup.watch.check()  # idle and due: probes
    assert g.sup.is_ready() and g.sup.state is EngineState.READY


async def test_an_engine_with_recent_output_is_not_probed(make_guard: Callable[..., Any]) -> None:
    """Real output stands in for the probe (#16: a probe at every idle moment of a busy engine cost each
    request CPU in the API process and the engine)."""
    g = await make_guard(ready_probe_interval=10)
    engine = g.factory.current
    g.clock.now += 8
    assert await g.collect([1, 2, 3]) == greedy_tokens([1, 2, 3], 4)  # real output at t = 8
    g.clock.now += 8  # 16 s after the start-up probe, 8 s after the output
    await g.sup.watch.check()
    assert not [r for r in engine.requests[1:] if r.startswith("vlguard-probe-")]
    g.clock.now += 3  # 11 s without output: due
    await g.sup.watch.check()
    assert [r for r in engine.requests[1:] if r.startswith("vlguard-probe-")]


async def test_failed_probe_is_a_death(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(ready_probe_interval=10)
    g.factory.current.die()
    g.clock.now += 11
    await g.sup.watch.check()
    await g.state(EngineState.READY)
    assert g.sup.generation == 2


class _Renderer:
    shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


class _OwnRenderers(FakeEngineFactory):
    """Engines with a renderer of their own, shared with their input processor (as ``AsyncLLM`` builds)."""

    def __call__(self) -> Any:
        engine = super().__call__()
        engine.renderer = _Renderer()
        engine.input_processor = SimpleNamespace(renderer=engine.renderer)
        return engine


async def test_rebuilt_engines_report_the_serving_renderer_and_shut_down_their_own(
    make_guard: Callable[..., Any],
) -> None:
    """#16: vLLM's serving classes keep the first engine's renderer (and its processor cache), so a rebuilt
    engine's output handler must report that one's statistics; its own renderer ends with it, the serving
    one never does."""
    g = await make_guard(_OwnRenderers(), ready_probe_interval=10)
    first = g.factory.current
    serving = first.renderer
    for generation in (2, 3):
        g.factory.current.die()
        g.clock.now += 11
        await g.sup.watch.check()  # the probe fails: a death, then a rebuild
        await g.state(EngineState.READY)
        assert g.sup.generation == generation and g.factory.current.renderer is serving
    second, third = g.factory.engines[1:]
    assert second.input_processor.renderer.shut_down and not third.input_processor.renderer.shut_down
    assert not serving.shut_down and first.renderer is None and second.renderer is None  # detached
    await g.sup.shutdown()  # the last engine's own renderer ends at shutdown too
    assert third.input_processor.renderer.shut_down


async def test_request_in_flight_at_a_death_is_replayed_on_the_next_engine(make_guard: Callable[..., Any]) -> None:
    g = await make_guard()
    first = g.factory.current
    first.pause()
    task = asyncio.create_task(g.collect([5, 6], max_tokens=3))
    await asyncio.wait_for(first.wait_for_requests(2), WAIT_S)  # probe + this request
    first.die()
    assert await asyncio.wait_for(task, WAIT_S) == greedy_tokens([5, 6], 3)
    assert g.sup.generation == 2 and first.shut_down
    assert g.factory.current.prompts["r"] == [5, 6]  # replayed from scratch: nothing had been sent


async def test_stream_is_resumed_token_identical(make_guard: Callable[..., Any]) -> None:
    g = await make_guard()
    first = g.factory.current
    tokens: list[int] = []
    params = SamplingParams(max_tokens=6, temperature=0)
    params.output_kind = RequestOutputKind.DELTA
    async for out in g.client.generate({"prompt_token_ids": [9, 9]}, params, "s"):
        tokens += out.outputs[0].token_ids
        if len(tokens) == 2 and g.sup.generation == 1:
            first.die()  # after two tokens were delivered
    assert tokens == greedy_tokens([9, 9], 6)
    resumed = g.factory.current.prompts["s"]
    assert resumed == [9, 9, *tokens[:2]]  # continued from the prompt plus what was sent


async def test_restart_budget_spent_fails_once_and_refuses(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(restart_max=2, restart_window=600)
    for _ in range(2):
        g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
        await g.state(EngineState.READY)
    g.clock.now += 10
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await g.state(EngineState.FAILED)
    assert g.failed_calls == 1 and not g.sup.healthy()
    with pytest.raises(EngineUnavailableError) as err:
        await g.sup.acquire()
    assert err.value.reason == "engine_failed"


async def test_restart_budget_counts_only_the_window(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(restart_max=1, restart_window=60)
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await g.state(EngineState.READY)
    g.clock.now += 61  # the first restart left the window
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await g.state(EngineState.READY)
    assert g.sup.generation == 3 and g.failed_calls == 0


async def test_failed_builds_back_off_exponentially(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(restart_backoff=0.5, restart_max=10)
    g.factory.fail = 3
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await g.state(EngineState.READY)
    assert g.slept == [0.5, 1.0, 2.0] and g.sup.generation == 2


async def test_builds_that_keep_failing_exhaust_the_budget(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(restart_max=3)
    g.factory.fail = 100
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await g.state(EngineState.FAILED)
    assert g.factory.attempts == 1 + 3 and g.failed_calls == 1


async def test_requests_are_held_while_restarting_then_served(make_guard: Callable[..., Any]) -> None:
    g = await make_guard()
    g.factory.gate.clear()  # the next build blocks: an engine still loading
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await g.state(EngineState.RESTARTING)
    task = asyncio.create_task(g.collect([1], max_tokens=2))
    await asyncio.sleep(0)
    assert not task.done()
    g.factory.gate.set()
    assert await asyncio.wait_for(task, WAIT_S) == greedy_tokens([1], 2)


async def test_hold_timeout_and_max_held_give_503(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(hold_timeout=0.05, max_held=1)
    g.factory.gate.clear()
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await g.state(EngineState.RESTARTING)
    held = asyncio.create_task(g.sup.acquire())
    await asyncio.sleep(0)
    with pytest.raises(EngineUnavailableError) as too_many:
        await g.sup.acquire()
    assert too_many.value.reason == "too_many_held"
    with pytest.raises(EngineUnavailableError) as timeout:
        await held
    assert timeout.value.reason == "hold_timeout"
    g.factory.gate.set()
    await g.state(EngineState.READY)


async def test_poison_is_quarantined_and_innocents_are_not(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(quarantine_deaths=2, max_replays=5)
    poison = asyncio.create_task(g.collect([1, POISON], rid="poison"))
    innocents = [asyncio.create_task(g.collect([7, i], rid=f"ok{i}")) for i in range(3)]
    with pytest.raises(QuarantinedRequestError):
        await asyncio.wait_for(poison, WAIT_S)
    results = await asyncio.wait_for(asyncio.gather(*innocents), WAIT_S)
    assert results == [greedy_tokens([7, i], 4) for i in range(3)]
    assert g.sup.generation == 3  # two deaths, both charged to the poison alone in the end
    with pytest.raises(QuarantinedRequestError):  # and it is refused from now on, without touching the engine
        await g.collect([1, POISON], rid="again")
    assert "again" not in g.factory.current.requests


async def test_fingerprints_are_computed_only_once_something_is_charged(
    make_guard: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's fingerprint (~20 us for a 740-token prompt) is read only when the quarantine remembers
    a strike, for a suspect, or when a fault is charged: never while nothing has faulted."""
    from server.guard import quarantine

    computed: list[object] = []
    real = quarantine._hashed

    def counted(prompt: Any, content: bytes) -> str:
        computed.append(prompt)
        return real(prompt, content)

    monkeypatch.setattr(quarantine, "_hashed", counted)
    g = await make_guard(quarantine_deaths=2, max_replays=5)
    assert [await g.collect([7, i], rid=f"ok{i}") for i in range(3)] == [greedy_tokens([7, i], 4) for i in range(3)]
    assert computed == []
    with pytest.raises(QuarantinedRequestError):  # two faults charged: computed for those in the engine
        await asyncio.wait_for(g.collect([1, POISON], rid="poison"), WAIT_S)
    assert computed
    computed.clear()
    assert await g.collect([7, 9], rid="after") == greedy_tokens([7, 9], 4)
    assert len(computed) == 1  # the quarantine remembers strikes now: each request is checked


async def test_soft_recovery_quarantines_the_poison_without_a_rebuild(make_guard: Callable[..., Any]) -> None:
    """#15: the engine absorbs each fault (ERROR finishes + a soft-fault record); the guard carries the cut
    requests over onto the same engine, charges only the failing step's, and quarantines the poison."""
    g = await make_guard(FakeEngineFactory(poison=[POISON], soft=True), quarantine_deaths=2, max_replays=5)
    engine = g.factory.current
    engine.pause()
    seen = len(engine.requests)
    # Streams (the fake yields every step; vLLM's non-streaming requests yield nothing before they end).
    innocents = [asyncio.create_task(g.collect([7, i], stream=True, rid=f"ok{i}")) for i in range(3)]
    stream = asyncio.create_task(g.collect([5], max_tokens=6, stream=True, rid="s"))
    poison = asyncio.create_task(g.collect([1, POISON], rid="poison"))
    await asyncio.wait_for(engine.wait_for_requests(seen + 5), WAIT_S)
    engine.resume()
    with pytest.raises(QuarantinedRequestError):
        await asyncio.wait_for(poison, WAIT_S)
    assert await asyncio.wait_for(asyncio.gather(*innocents), WAIT_S) == [greedy_tokens([7, i], 4) for i in range(3)]
    assert await asyncio.wait_for(stream, WAIT_S) == greedy_tokens([5], 6)
    assert (g.sup.generation, engine.soft_faults, g.factory.attempts) == (1, 2, 1)  # no rebuild
    assert g.sup.quarantine.quarantined_count() == 1  # the poison alone


async def test_a_stream_with_a_stop_string_cut_by_a_soft_recovery_sends_what_it_sends_uninterrupted(
    make_guard: Callable[..., Any],
) -> None:
    """vLLM holds back the last characters of a stop-string stream's text (they may start the stop string)
    and a finished output releases them; the ERROR finish of a cut does too. Handed on, they were text an
    uninterrupted stream had not sent, and the re-run's seam check ended the stream as diverged (CI, 0.32)."""
    g = await make_guard(FakeEngineFactory(poison=[POISON], soft=True), quarantine_deaths=2, max_replays=5)
    engine = g.factory.current

    async def run(rid: str, cut_after: int | None) -> tuple[list[int], str]:
        params = SamplingParams(max_tokens=6, temperature=0, stop=["never"], output_kind=RequestOutputKind.DELTA)
        assert params.output_text_buffer_length == 4
        ids, text = [], ""
        async for out in g.client.generate({"prompt_token_ids": [5]}, params, rid):
            ids, text = ids + out.outputs[0].token_ids, text + out.outputs[0].text
            if len(ids) == cut_after:  # a soft recovery now cuts this stream (and the poison)
                seen = len(engine.requests)
                poison = asyncio.create_task(g.collect([1, POISON], rid=f"poison-{rid}"))
                await asyncio.wait_for(engine.wait_for_requests(seen + 1), WAIT_S)
        if cut_after is not None:
            with pytest.raises(QuarantinedRequestError):
                await asyncio.wait_for(poison, WAIT_S)
        return ids, text

    uninterrupted = await run("whole", None)
    assert uninterrupted == (greedy_tokens([5], 6), "".join(f" t{t}" for t in greedy_tokens([5], 6)))
    assert await run("cut", 2) == uninterrupted
    assert engine.prompts["cut"] == [5]  # re-run from its start, not resumed


async def test_an_error_finish_without_a_soft_recovery_is_passed_through(make_guard: Callable[..., Any]) -> None:
    """An ERROR finish vLLM gives for its own reasons (a grammar that rejects tokens, a failed KV load) is
    the request's answer, not a fault: no replay."""
    from vllm.outputs import CompletionOutput, RequestOutput

    g = await make_guard()
    engine = g.factory.current

    async def errors(prompt: Any, params: Any, request_id: str, **_: Any) -> Any:
        done = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                finish_reason="error")  # fmt: skip
        yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1], prompt_logprobs=None,
                            outputs=[done], finished=True)  # fmt: skip

    engine.generate = errors
    outputs = [o async for o in g.client.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=2), "e")]
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"]


async def test_replay_limit(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(max_replays=1, quarantine_deaths=10)
    task = asyncio.create_task(g.collect([1, POISON], rid="p"))
    with pytest.raises(EngineUnavailableError) as err:
        await asyncio.wait_for(task, WAIT_S)
    assert err.value.reason == "replay_limit"


async def stalled_request(g: Guard) -> tuple[Any, asyncio.Task[list[int]]]:
    """Pause the current engine and start a 2-token request on it: ``(engine, request task)`` once the
    engine holds it (the start-up probe and the request)."""
    engine = g.factory.current
    engine.pause()
    task = asyncio.create_task(g.collect([3], max_tokens=2))
    await asyncio.wait_for(engine.wait_for_requests(2), WAIT_S)
    return engine, task


async def test_hang_is_detected_by_the_clock(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(hang_timeout=60)
    first, task = await stalled_request(g)
    g.clock.now += 59
    await g.sup.watch.check()
    assert g.sup.state is EngineState.READY and g.sup.generation == 1  # not yet
    g.clock.now += 2
    await g.sup.watch.check()
    assert await asyncio.wait_for(task, WAIT_S) == greedy_tokens([3], 2)
    assert g.sup.generation == 2 and first.shut_down


async def test_engine_steps_without_request_output_are_not_a_hang(make_guard: Callable[..., Any]) -> None:
    # A non-streaming request yields nothing until it ends; the engine core's step outputs keep the clock.
    g = await make_guard(hang_timeout=60)
    first, task = await stalled_request(g)
    for _ in range(3):  # 177 s of steps with no request output
        g.clock.now += 59
        await first.engine_core.get_output_async()
        await g.sup.watch.check()
        assert g.sup.state is EngineState.READY and g.sup.generation == 1
    g.clock.now += 61  # then the engine core goes quiet: a hang
    await g.sup.watch.check()
    assert await asyncio.wait_for(task, WAIT_S) == greedy_tokens([3], 2)
    assert g.sup.generation == 2 and first.shut_down


async def test_shutdown_stops_the_engine_and_refuses(make_guard: Callable[..., Any]) -> None:
    g = await make_guard()
    engine = g.factory.current
    await g.sup.shutdown()
    assert engine.shut_down and g.sup.state is EngineState.STOPPED
    with pytest.raises(EngineUnavailableError):
        await g.sup.acquire()


async def test_first_start_failure_is_failed(make_guard: Callable[..., Any]) -> None:
    with pytest.raises(RuntimeError):
        await make_guard(FakeEngineFactory(fail=1))


async def test_stop_requested_during_first_startup_does_not_wait_for_the_engine() -> None:
    factory = FakeEngineFactory()
    factory.gate.clear()  # the first engine never finishes loading on its own
    g = Guard(factory, shutdown_timeout=0.2)
    start = asyncio.create_task(g.sup.start())
    await asyncio.to_thread(factory.building.wait, WAIT_S)
    g.sup.request_stop()
    with pytest.raises(EngineUnavailableError) as err:
        await asyncio.wait_for(start, WAIT_S)
    assert err.value.reason == "stopped" and g.sup.state is EngineState.STOPPED
    await asyncio.wait_for(g.sup.shutdown(), WAIT_S)  # bounded although the build still runs
    assert g.sup.builder.abandoned_build
    factory.gate.set()  # let the thread finish


async def test_shutdown_during_a_rebuild_shuts_down_what_the_build_produced(make_guard: Callable[..., Any]) -> None:
    g = await make_guard(shutdown_timeout=WAIT_S)
    g.factory.gate.clear()
    g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
    await asyncio.to_thread(g.factory.building.wait, WAIT_S)
    stopping = asyncio.create_task(g.sup.shutdown())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # waits (bounded) for the build in progress
    g.factory.gate.set()
    await asyncio.wait_for(stopping, WAIT_S)
    assert len(g.factory.engines) == 2 and g.factory.current.shut_down and not g.sup.builder.abandoned_build


async def test_external_kills_charge_nobody(make_guard: Callable[..., Any]) -> None:
    """Identical requests in flight at engine deaths nothing recorded as their fault (SIGKILL, OOM kill,
    segfault, hang): never quarantined, however often (#20)."""
    g = await make_guard(quarantine_deaths=2, max_replays=10, restart_max=20)
    for _ in range(6):
        engine = g.factory.current
        engine.pause()
        seen = len(engine.requests)
        tasks = [asyncio.create_task(g.collect([4, 2], rid=f"same{i}")) for i in range(3)]  # one fingerprint
        await asyncio.wait_for(engine.wait_for_requests(seen + 3), WAIT_S)
        engine.die()  # no fatal record: a kill from outside
        assert await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S) == [greedy_tokens([4, 2], 4)] * 3
    assert g.sup.generation == 7
    assert g.sup.quarantine.entries() == [] and g.sup.quarantine.quarantined_count() == 0


async def test_a_step_exception_charges_only_the_requests_of_that_step(make_guard: Callable[..., Any]) -> None:
    import json

    from server.engine.protocol import FatalRecord
    from server.guard.supervisor import charged_requests

    g = await make_guard(quarantine_deaths=1)
    engine = g.factory.current
    engine.pause()
    seen = len(engine.requests)
    tasks = {rid: asyncio.create_task(g.collect([9, i], rid=rid)) for i, rid in enumerate(["a", "b", "c"])}
    await asyncio.wait_for(engine.wait_for_requests(seen + 3), WAIT_S)
    record = {"type": "ValueError", "message": "boom", "step_requests": ["b-0f0f0f0f"], "new_requests": ["b-0f0f0f0f"]}
    (g.sup.builder.engine_dir(g.sup.generation) / "fatal-1.json").write_text(json.dumps(record))
    engine.die()
    with pytest.raises(QuarantinedRequestError):
        await asyncio.wait_for(tasks["b"], WAIT_S)
    assert [await asyncio.wait_for(tasks[r], WAIT_S) for r in ("a", "c")] == [
        greedy_tokens([9, 0], 4),
        greedy_tokens([9, 2], 4),
    ]
    assert g.sup.quarantine.quarantined_count() == 1
    assert charged_requests({"a": "x", "b-c": "y"}, None) == []  # no record, no charge
    n2 = FatalRecord("ValueError", "boom", ["0_chatcmpl-9-0f0f0f0f", "1_chatcmpl-9-0f0f0f0f"])
    assert charged_requests({"chatcmpl-9": "x", "chatcmpl-1": "y"}, n2) == ["chatcmpl-9"]  # n > 1 samples
    assert g.sup.quarantine.clear() == 1 and g.sup.quarantine.quarantined_count() == 0


async def test_requests_sharing_a_client_chosen_id_are_tracked_and_charged_apart(
    make_guard: Callable[..., Any],
) -> None:
    """#44: a client picks the serving layer's request id (``X-Request-Id``). Three requests with one id
    are three entries on the ledger (the gauge says 3), go to the engine under three ids, and a step
    fault of one of them is charged to that one alone; an abort by the shared id reaches all of them."""
    import json

    from server.metrics import definitions as m

    g = await make_guard(quarantine_deaths=1)
    engine = g.factory.current
    engine.pause()
    seen = len(engine.requests)
    prompts = {"ok0": [9, 0], "bad": [9, 1], "ok2": [9, 2]}
    tasks = {name: asyncio.create_task(g.collect(p, rid="same")) for name, p in prompts.items()}
    await asyncio.wait_for(engine.wait_for_requests(seen + 3), WAIT_S)
    engine_ids = sorted(engine.active)
    assert len(engine_ids) == 3 and "same" in engine_ids  # the first keeps its id, the others a suffix
    assert len(g.sup.inflight) == 3 and m.REQUESTS_INFLIGHT._value.get() == 3
    bad = next(rid for rid, prompt in engine.inputs.items() if prompt["prompt_token_ids"] == [9, 1])
    record = {"type": "ValueError", "message": "boom", "step_requests": [f"{bad}-0f0f0f0f"], "new_requests": []}
    (g.sup.builder.engine_dir(g.sup.generation) / "fatal-1.json").write_text(json.dumps(record))
    engine.die()
    with pytest.raises(QuarantinedRequestError):
        await asyncio.wait_for(tasks["bad"], WAIT_S)
    assert await asyncio.wait_for(tasks["ok0"], WAIT_S) == greedy_tokens([9, 0], 4)
    assert await asyncio.wait_for(tasks["ok2"], WAIT_S) == greedy_tokens([9, 2], 4)
    assert g.sup.quarantine.quarantined_count() == 1

    engine = g.factory.current
    engine.pause()
    seen = len(engine.requests)
    waiting = [asyncio.create_task(g.collect([5, i], rid="dup")) for i in range(2)]
    await asyncio.wait_for(engine.wait_for_requests(seen + 2), WAIT_S)
    aborted: list[Any] = []
    engine.abort = lambda ids: aborted.append(ids) or asyncio.sleep(0)  # type: ignore[method-assign]
    await g.client.abort("dup")
    assert sorted(aborted[0]) == sorted(rid for rid in engine.active)
    engine.resume()
    await asyncio.wait_for(asyncio.gather(*waiting), WAIT_S)
    assert not g.client._engine_ids and not g.client._in_engine  # nothing left behind


async def test_a_client_chosen_id_never_collides_with_an_assigned_one(make_guard: Callable[..., Any]) -> None:
    """#61: vlguard gives a repeated id a ``~N`` suffix; a client may pick exactly such an id. Every id
    inside the engine is still unique: the picked one, and the repeat, whichever comes first."""
    g = await make_guard()
    engine = g.factory.current
    engine.pause()
    seen = len(engine.requests)
    first = [asyncio.create_task(g.collect([5, i], rid="pick")) for i in range(2)]
    await asyncio.wait_for(engine.wait_for_requests(seen + 2), WAIT_S)
    assigned = next(rid for rid in engine.active if rid != "pick")
    again = asyncio.create_task(g.collect([5, 9], rid=assigned))  # a client writes the id vlguard assigned
    await asyncio.wait_for(engine.wait_for_requests(seen + 3), WAIT_S)
    assert len(set(engine.active)) == len(engine.active) == 3, engine.active
    engine.resume()
    await asyncio.wait_for(asyncio.gather(*first, again), WAIT_S)
    assert not g.client._engine_ids and not g.client._in_engine


async def test_a_suspect_runs_alone_and_holds_newcomers_only_during_its_first_step(
    make_guard: Callable[..., Any],
) -> None:
    """#20 probation isolates for real: a suspect waits for the request already inside to finish, runs
    alone, and a newcomer enters only once the suspect's first step has produced output."""
    from server.guard.quarantine import fingerprint

    g = await make_guard(probation_drain_timeout=WAIT_S)
    engine = g.factory.current
    engine.pause()
    seen = len(engine.requests)
    running = asyncio.create_task(g.collect([1, 1], max_tokens=3, rid="running"))
    await asyncio.wait_for(engine.wait_for_requests(seen + 1), WAIT_S)
    suspect_params = SamplingParams(max_tokens=4, temperature=0)
    g.sup.quarantine.record_death([fingerprint({"prompt_token_ids": [6, 6]}, suspect_params)])  # one strike
    suspect = asyncio.create_task(g.collect([6, 6], rid="suspect"))
    await asyncio.sleep(0.05)
    newcomer = asyncio.create_task(g.collect([2, 2], rid="newcomer"))
    await asyncio.sleep(0.05)
    assert engine.requests[seen:] == ["running"]  # the suspect waits for the engine to empty; so does the newcomer
    engine.resume()
    results = await asyncio.wait_for(asyncio.gather(running, suspect, newcomer), WAIT_S)
    assert results == [greedy_tokens([1, 1], 3), greedy_tokens([6, 6], 4), greedy_tokens([2, 2], 4)]
    assert engine.requests[seen:] == ["running", "suspect", "newcomer"]


async def test_a_suspect_runs_beside_others_after_the_drain_timeout(make_guard: Callable[..., Any]) -> None:
    from server.guard.quarantine import fingerprint

    g = await make_guard(probation_drain_timeout=0.05)
    engine = g.factory.current
    engine.pause()
    seen = len(engine.requests)
    running = asyncio.create_task(g.collect([1, 1], max_tokens=3, rid="running"))
    await asyncio.wait_for(engine.wait_for_requests(seen + 1), WAIT_S)
    g.sup.quarantine.record_death(
        [fingerprint({"prompt_token_ids": [6, 6]}, SamplingParams(max_tokens=4, temperature=0))]
    )
    suspect = asyncio.create_task(g.collect([6, 6], rid="suspect"))
    await asyncio.wait_for(engine.wait_for_requests(seen + 2), WAIT_S)  # bounded: it went in beside "running"
    engine.resume()
    await asyncio.wait_for(asyncio.gather(running, suspect), WAIT_S)


async def test_faults_charged_to_one_request_spend_its_clients_budget_not_the_restart_budget(
    make_guard: Callable[..., Any],
) -> None:
    """#33: a poison that kills its engine twice (charged each time: it ran alone) is quarantined without
    spending the restart budget (one restart allowed here, two rebuilt), and its client, not the engine,
    pays: with a budget of two faults the client is refused; another client is not."""
    g = await make_guard(quarantine_deaths=2, max_replays=5, restart_max=1, client_fault_max=2, client_cooldown=30)

    async def as_client(client: str, ids: list[int], rid: str) -> list[int]:
        current_client.set(client)
        return await g.collect(ids, rid=rid)

    with pytest.raises(QuarantinedRequestError):
        await asyncio.wait_for(as_client("addr:10.0.0.9", [1, POISON], "poison"), WAIT_S)
    await g.state(EngineState.READY, EngineState.FAILED)
    assert (g.sup.generation, g.sup.state, g.failed_calls) == (3, EngineState.READY, 0)
    with pytest.raises(ClientRefusedError) as refused:
        g.sup.clients.check("addr:10.0.0.9")
    assert refused.value.status == 429 and 29 < refused.value.retry_after_s <= 30
    g.sup.clients.check("addr:10.0.0.7")  # another client is served
    assert await as_client("addr:10.0.0.7", [7, 1], "ok") == greedy_tokens([7, 1], 4)
    g.clock.now += 31
    g.sup.clients.check("addr:10.0.0.9")  # the cool-down is over


def test_client_budget_counts_within_the_window_and_refuses_again_inside_it() -> None:
    clock = ManualClock()
    budget = ClientBudget(max_faults=2, window_s=100, cooldown_s=10, clock=clock)
    assert budget.charge(["a"]) == [] and budget.refused_for("a") == 0
    clock.now += 50
    assert budget.charge(["a", "b"]) == ["a"]  # two within 100 s
    assert budget.refused_for("a") == 10 and budget.refused_count() == 1
    clock.now += 11
    assert budget.refused_for("a") == 0  # cool-down over, but its faults still count in the window
    assert budget.charge(["a"]) == ["a"]
    clock.now += 200
    assert budget.charge(["a"]) == [] and budget.refused_for("a") == 0  # the window moved on
    assert ClientBudget(0, 100, 10).charge(["a"] * 5) == []  # 0: never refuse


def test_client_key_is_a_key_among_several_else_a_non_loopback_address() -> None:
    scope = {"headers": [(b"authorization", b"Bearer sk-123")], "client": ("198.51.100.7", 5000)}
    assert client_key(scope, keys=2).startswith("key:") and "sk-123" not in client_key(scope, keys=2)
    assert client_key(scope, keys=1) == "addr:198.51.100.7"  # one shared key tells no client apart
    assert client_key(scope, keys=0) == "addr:198.51.100.7"
    # Behind a proxy or sidecar on the host every client is loopback: no identity, no client budget.
    assert client_key({**scope, "client": ("127.0.0.1", 5000)}, keys=0) == ""
    assert client_key({"headers": []}, keys=2) == ""
