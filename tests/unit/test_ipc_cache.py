"""#16: the guard strips processed images per engine core (server.guard.ipc_cache) and undoes it where the
engine core cannot serve the stripped request: a rebuilt engine core gets the replay whole, a soft
recovery's emptied cache is forgotten, and a receiver miss (drift) is sent again whole. vLLM's own
``lru`` sender is the shadow; the engine is the fake, whose receiver keeps the hashes it was sent data for."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalKwargsItems,
)
from vllm.sampling_params import RequestOutputKind

from server.guard.ipc_cache import EngineCacheShadow, cache_miss
from server.guard.supervisor import EngineState
from server.metrics import definitions as m
from server.vllm_hooks import processor_cache as replay_cache
from server.vllm_hooks.locations import lru_sender_cache
from tests.fakes import FakeEngineFactory, GuardHarness, greedy_tokens

WAIT_S = 10
ITEM_BYTES = 4096


def model_config(cache_gb: float = 1.0) -> Any:
    """What vLLM's caches read of a model config: the multimodal config's cache size."""
    mm = SimpleNamespace(mm_processor_cache_gb=cache_gb)
    return SimpleNamespace(get_multimodal_config=lambda: mm)


def item(seed: int) -> MultiModalKwargsItem:
    data = torch.full((ITEM_BYTES // 4,), float(seed))
    return MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(data=data, field=MultiModalBatchedField())})


def prompt(*hashes: str, ids: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """A rendered multimodal prompt as vlguard's renderer makes it: every image with its data."""
    return {
        "type": "multimodal",
        "prompt_token_ids": list(ids),
        "mm_kwargs": MultiModalKwargsItems({"image": [item(int(h[1:])) for h in hashes]}),
        "mm_hashes": {"image": list(hashes)},
    }


def sent_data(p: dict[str, Any]) -> list[bool]:
    return [x is not None for x in p["mm_kwargs"]["image"]]


def test_a_repeat_goes_as_its_hash_and_the_rendered_prompt_keeps_its_data() -> None:
    shadow = EngineCacheShadow(lru_sender_cache(model_config()))
    first, stripped = shadow.strip(rendered := prompt("h1"))
    assert first is rendered and not stripped
    again, stripped = shadow.strip(rendered)
    assert stripped and sent_data(again) == [False] and sent_data(rendered) == [True]
    assert type(again["mm_kwargs"]) is MultiModalKwargsItems and again["prompt_token_ids"] == [1, 2, 3]
    mixed, stripped = shadow.strip(prompt("h1", "h2"))
    assert stripped and sent_data(mixed) == [False, True]
    fresh = EngineCacheShadow(lru_sender_cache(model_config()))  # a rebuilt engine core's
    assert sent_data(fresh.strip(prompt("h1", "h2"))[0]) == [True, True]


def test_the_shadow_evicts_as_the_receiver_does() -> None:
    """Room for two items: the least recently sent goes first, so it is sent whole again."""
    shadow = EngineCacheShadow(lru_sender_cache(model_config(cache_gb=2.5 * ITEM_BYTES / 2**30)))
    for h in ("h1", "h2", "h1", "h3"):  # h2 is the least recently used when h3 arrives
        shadow.strip(prompt(h))
    assert sent_data(shadow.strip(prompt("h1"))[0]) == [False]
    assert sent_data(shadow.strip(prompt("h2"))[0]) == [True]


def test_prompts_without_images_pass_unchanged() -> None:
    shadow = EngineCacheShadow(lru_sender_cache(model_config()))
    for p in ({"prompt_token_ids": [1]}, "text", {"prompt_token_ids": [1], "mm_kwargs": {}, "mm_hashes": {}}):
        assert shadow.strip(p) == (p, False)
    odd = {**prompt("h1"), "mm_hashes": {"image": ["h1", "h2"]}}  # a shape vLLM does not make: sent as it is
    assert shadow.strip(odd) == (odd, False)


class Guard(GuardHarness):
    """Fake engines that keep a receiver cache; vlguard's renderer replaced the split cache (so the engine
    cores hold one)."""

    def __init__(self, **engine: Any) -> None:
        factory = FakeEngineFactory(receiver=True, model_config=model_config(), **engine)
        super().__init__(factory, wait_s=WAIT_S, restart_backoff=0.0)

    async def ask(self, p: dict[str, Any], rid: str, max_tokens: int = 4, stream: bool = False) -> list[int]:
        return await self.collect(p, max_tokens, stream, rid, no_error=True)


@pytest.fixture
async def guard(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Guard]:
    monkeypatch.setattr(replay_cache, "_replaced", True)
    g = Guard()
    await g.sup.start()
    yield g
    await g.sup.shutdown()


async def test_repeats_go_as_hashes_to_the_engine_core_that_holds_them(guard: Guard) -> None:
    engine = guard.factory.current
    assert await guard.ask(prompt("h1"), "a") == greedy_tokens([1, 2, 3], 4)
    assert await guard.ask(prompt("h1"), "b") == greedy_tokens([1, 2, 3], 4)
    assert sent_data(engine.inputs["a"]) == [True] and sent_data(engine.inputs["b"]) == [False]


async def test_a_stripped_request_replayed_after_a_rebuild_reaches_the_new_engine_core_whole(guard: Guard) -> None:
    """The trap of #16: the request was stripped for the first engine core, which then died."""
    first = guard.factory.current
    await guard.ask(prompt("h1"), "a")
    resends = m.MM_CACHE_RESENDS._value.get()
    first.pause()
    n = len(first.requests)
    stream = asyncio.create_task(guard.ask(prompt("h1"), "b", max_tokens=6, stream=True))
    await asyncio.wait_for(first.wait_for_requests(n + 1), WAIT_S)
    assert sent_data(first.inputs["b"]) == [False]
    first.die()
    assert await asyncio.wait_for(stream, WAIT_S) == greedy_tokens([1, 2, 3], 6)
    second = guard.factory.current
    assert second is not first and sent_data(second.inputs["b"]) == [True]
    assert m.MM_CACHE_RESENDS._value.get() == resends  # whole at once, not after a miss


async def test_requests_with_several_samples_are_sent_whole(guard: Guard) -> None:
    """A stream's samples reach the engine client one by one: a miss could not be told from an error."""
    engine = guard.factory.current
    await guard.ask(prompt("h1"), "a")
    params = SamplingParams(max_tokens=2, temperature=1.0, n=2, output_kind=RequestOutputKind.DELTA)
    async for _ in guard.client.generate(prompt("h1"), params, "b"):
        pass
    assert sent_data(engine.inputs["b"]) == [True]


async def test_a_receiver_miss_is_sent_again_whole(guard: Guard) -> None:
    engine = guard.factory.current
    await guard.ask(prompt("h1"), "a")
    engine.held.clear()  # the engine core's cache drifted from the guard's shadow
    resends = m.MM_CACHE_RESENDS._value.get()
    assert await guard.ask(prompt("h1"), "b", stream=True) == greedy_tokens([1, 2, 3], 4)
    assert m.MM_CACHE_RESENDS._value.get() == resends + 1
    assert sent_data(engine.inputs["b"]) == [True]  # its second submission: whole
    assert guard.sup.state is EngineState.READY


async def test_a_soft_recovery_keeps_the_engine_cores_cache_and_the_shadow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay_cache, "_replaced", True)
    g = Guard(soft=True, poison=[666])
    await g.sup.start()
    try:
        engine = g.factory.current
        await g.ask(prompt("h1"), "a")
        poisoned = prompt("h1", ids=(1, 666, 3))
        with pytest.raises(Exception):  # noqa: B017 - charged and quarantined or refused: not this test's point
            await g.ask(poisoned, "p")
        resends = m.MM_CACHE_RESENDS._value.get()
        assert engine.soft_faults >= 1 and g.factory.current is engine
        await g.ask(prompt("h1"), "c")
        assert sent_data(engine.inputs["c"]) == [False] and m.MM_CACHE_RESENDS._value.get() == resends
    finally:
        await g.sup.shutdown()


def test_only_a_first_error_without_tokens_after_stripping_is_a_miss() -> None:
    from vllm.outputs import CompletionOutput, RequestOutput

    def out(reason: str | None, tokens: list[int], finished: bool = True) -> RequestOutput:
        done = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                                finish_reason=reason)  # fmt: skip
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], prompt_logprobs=None,
                             outputs=[done], finished=finished)  # fmt: skip

    assert cache_miss(out("error", []), stripped=True, first=True)
    assert not cache_miss(out("error", []), stripped=False, first=True)
    assert not cache_miss(out("error", []), stripped=True, first=False)
    assert not cache_miss(out("error", [5]), stripped=True, first=True)
    assert not cache_miss(out("length", []), stripped=True, first=True)


def test_serve_wraps_the_factory_even_where_the_plugin_wrapped_the_chooser_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """VLGUARD_REPLAY_CACHE=1 inherited by the API process: vLLM loads the plugin before serve installs."""
    import server.vllm_hooks.locations as compat

    wrapped: list[str] = []
    monkeypatch.setattr(compat, "wrap_mm_cache_type", lambda wrap: wrapped.append(wrap.__name__) or "chooser")
    monkeypatch.setattr(
        compat, "wrap_mm_processor_cache_factory", lambda wrap: wrapped.append(wrap.__name__) or "factory"
    )
    monkeypatch.setattr(replay_cache, "_chooser_at", None)
    monkeypatch.setattr(replay_cache, "_factory_at", None)
    monkeypatch.setenv(replay_cache.ENV, "1")
    replay_cache.register()
    assert replay_cache.install() == "chooser, factory"
    replay_cache.register()
    assert replay_cache.install() == "chooser, factory"
    assert wrapped == ["engine_receiver", "replay_safe"]  # each once
