"""#33 in-process: inputs known to fault vLLM's engine are refused at the door with 400 before the engine
sees them (one per kind; tests/unit/test_poison.py covers each kind's members), their valid neighbours
reach it, and the bodies inside the API process are bounded by bytes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from server.guard.supervisor import EngineState
from server.workload.images import photo_uri
from tests.helpers import POISON_CASES, chat_body
from tests.inprocess import Api

CHAT = "/v1/chat/completions"


def text_chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Is the exit clear?"}], "max_tokens": 2, **extra}


def big_chat(model: str, size: int) -> dict[str, Any]:
    """A chat whose body is about ``size`` bytes, every byte of it something the door lets through: a noise
    image (text that large would not fit the tiny model's context; a field beside the input holds 64 KiB)."""
    import base64
    import io
    import os

    from PIL import Image

    side = int((size * 3 / 4 / 3) ** 0.5)  # base64 of raw-sized PNG rows: 4 bytes per 3
    buf = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)).save(buf, "PNG", compress_level=0)
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "text", "text": "Is the exit clear?"}, {"type": "image_url", "image_url": {"url": uri}}]
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 2}


@pytest.mark.parametrize("case", list(POISON_CASES))
async def test_known_poison_is_refused_before_the_engine(api: Api, case: str) -> None:
    extra, needle = POISON_CASES[case]
    seen = len(api.engine.requests)
    resp = await api.client.post(CHAT, json=text_chat(api.model, **extra))
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    assert len(api.engine.requests) == seen  # the engine never saw it


async def test_a_non_finite_sampling_value_is_refused(api: Api) -> None:
    raw = json.dumps(text_chat(api.model))[:-1] + ', "temperature": NaN}'
    resp = await api.client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "NaN is not a finite JSON number" in resp.json()["error"]["message"]
    raw = json.dumps(text_chat(api.model))[:-1] + ', "temperature": 1e999}'  # overflows to inf when parsed
    resp = await api.client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("temperature: must be a finite")


async def test_truncation_into_an_image_is_400_not_500(api: Api) -> None:
    """vllm#57038: truncate_prompt_tokens below the image's tokens; stock answers 500."""
    body = chat_body(api.model, photo_uri("coffee.png"), truncate_prompt_tokens=5)
    resp = await api.client.post(CHAT, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"regex": "(ab){3}c"}},
        {"structured_outputs": {"json_object": True}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object"}}}},
        {"stop_token_ids": [0], "min_tokens": 1},
    ],
)
async def test_valid_neighbours_reach_the_engine(api: Api, extra: dict[str, Any]) -> None:
    seen = len(api.engine.requests)
    resp = await api.client.post(CHAT, json=text_chat(api.model, **extra))
    assert resp.status_code == 200, resp.text
    assert len(api.engine.requests) == seen + 1


async def test_bodies_are_bounded_by_bytes_413_429_serving(make_api: Any) -> None:
    """#33 item 4: with a 1 MiB budget a 2 MiB body could never fit (413); two bodies of 400 kB inside a
    paused engine leave no room for a third (429 + Retry-After while serving); a small request passes
    once they are done, and the budget is given back after each."""
    api: Api = await make_api("--guard-max-body-memory-mb", "1", "--guard-max-request-mb", "8")
    resp = await api.client.post(CHAT, json=big_chat(api.model, 2 << 20))
    assert resp.status_code == 413, resp.text
    engine = api.engine
    engine.pause()
    seen = len(engine.requests)
    inside = [asyncio.create_task(api.client.post(CHAT, json=big_chat(api.model, 400_000))) for _ in range(2)]
    try:
        await asyncio.wait_for(engine.wait_for_requests(seen + 2), 30)
        resp = await api.client.post(CHAT, json=big_chat(api.model, 400_000))
        assert resp.status_code == 429 and resp.headers["retry-after"], resp.text
        assert "bodies in progress" in resp.json()["error"]["message"]
    finally:
        engine.resume()
    assert [r.status_code for r in await asyncio.gather(*inside)] == [200, 200]
    assert (await api.client.post(CHAT, json=text_chat(api.model))).status_code == 200
    assert "vlguard_request_body_bytes 0.0" in (await api.client.get("/metrics")).text


async def test_held_bodies_count_against_the_budget(make_api: Any) -> None:
    """Bodies held while the engine restarts keep their bytes: once they fill the budget, the next body
    gets 503 at once instead of growing the process."""
    api: Api = await make_api("--guard-max-body-memory-mb", "1")
    api.supervisor.states.set(EngineState.RESTARTING)
    held = big_chat(api.model, 400_000)
    tasks = [asyncio.create_task(api.client.post(CHAT, json=held)) for _ in range(2)]
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while api.supervisor.states.held < 2:  # both wait at the door with their bodies read
            assert asyncio.get_running_loop().time() < deadline, "the requests were never held"
            await asyncio.sleep(0.01)
        resp = await api.client.post(CHAT, json=held)
        assert resp.status_code == 503, resp.text
    finally:
        api.supervisor.states.set(EngineState.READY)
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200, 200]


async def test_refused_constraints_leave_nothing_of_their_text_behind(api: Api) -> None:
    """Hostile review: the door's compile cache was keyed by the constraint's text and kept the backend's
    message (which quotes it): 40 refused 7 MB regexes held 280 MB after their requests, outside every
    body bound. Now each distinct constraint keeps a digest and a message of at most 1000 characters: five
    more refused constraints of 60 kB leave the traced memory where five left it (in-process the latest
    request's body stays referenced from the test's own context, so the first five's figure is not 0)."""
    import gc
    import secrets
    import tracemalloc

    size = 60_000  # the fields beside the input hold at most 64 KiB of text (a 7 MB regex is refused as such)

    async def refuse(count: int) -> int:
        for _ in range(count):  # an unclosed group: xgrammar refuses the regex, quoting it
            regex = "(" + secrets.token_hex(8) + "x" * size
            resp = await api.client.post(CHAT, json=text_chat(api.model, structured_outputs={"regex": regex}))
            assert resp.status_code == 400 and "cannot be compiled" in resp.text, resp.text[:300]
            assert len(resp.json()["error"]["message"]) < 2000
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        first, second = await refuse(5), await refuse(5)
    finally:
        tracemalloc.stop()
    assert second - first < size, f"five more refused constraints of {size} characters held {second - first} bytes"


async def test_distinct_valid_constraints_do_not_grow_the_process(api: Api) -> None:
    """Hostile review: every distinct constraint the door compiled stayed in the backend's cache of compiled
    grammars (~2 MB for a 3 KB regex; 400 requests grew the API process by 780 MB, and clearing the cache
    later gave nothing back). The door keeps verdicts only: 100 distinct valid regexes of 3 KB, served,
    leave the process's resident memory within 60 MB (200 MB and growing before)."""
    import secrets

    import psutil

    async def serve(count: int) -> None:
        for _ in range(count):
            regex = secrets.token_hex(8) + "x" * 3000
            resp = await api.client.post(CHAT, json=text_chat(api.model, structured_outputs={"regex": regex}))
            assert resp.status_code == 200, resp.text[:300]

    await serve(5)  # the backend built, its first allocations made
    before = psutil.Process().memory_info().rss
    await serve(100)
    grown = psutil.Process().memory_info().rss - before
    assert grown < 60 * 2**20, f"100 distinct constraints grew the process by {grown >> 20} MiB"
