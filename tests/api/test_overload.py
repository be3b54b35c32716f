"""#65 in-process: a request's deadline (X-Request-Timeout) ends it wherever it waits, with a 504 in the
OpenAI envelope (an error event on a stream already started), and the engine stops working for it; a
malformed or repeated deadline header is 400; the queue caps are flags on every lane."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tests.inprocess import Api

CHAT = "/v1/chat/completions"


def chat(model: str, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Is the exit clear?"}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip


async def test_a_request_past_its_deadline_in_the_engine_gets_504_and_leaves_the_engine(make_api: Any) -> None:
    api: Api = await make_api()
    api.engine.pause()  # the engine takes no step: the request waits inside it
    started = time.monotonic()
    resp = await api.client.post(CHAT, json=chat(api.model), headers={"X-Request-Timeout": "0.5"})
    took = time.monotonic() - started
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == 504 and "X-Request-Timeout of 0.5 s" in resp.json()["error"]["message"]
    assert 0.4 < took < 5
    for _ in range(100):  # vLLM's own cancellation ended its generate() on the engine
        if not api.engine.active:
            break
        await asyncio.sleep(0.01)
    assert not api.engine.active
    api.engine.resume()
    ok = await api.client.post(CHAT, json=chat(api.model), headers={"X-Request-Timeout": "30"})
    assert ok.status_code == 200, ok.text  # nothing else lost


async def test_a_stream_past_its_deadline_ends_with_an_error_event(make_api: Any) -> None:
    api: Api = await make_api()
    lines: list[str] = []
    api.engine.pause_after(3)  # three tokens out, then the engine stalls past the deadline
    async with api.client.stream(
        "POST", CHAT, json=chat(api.model, stream=True, max_tokens=64), headers={"X-Request-Timeout": "1"}
    ) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line:
                lines.append(line)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert any("choices" in e for e in events)
    assert events[-1]["error"]["code"] == 504, events[-1]
    assert lines[-1] == "data: [DONE]"
    api.engine.resume()


async def test_a_held_request_past_its_deadline_stops_waiting(make_api: Any) -> None:
    api: Api = await make_api("--guard-hold-timeout", "60")
    api.factory.gate.clear()  # the next build waits: requests are held at the door
    api.engine.die()
    try:
        for _ in range(200):
            if api.factory.building.is_set():
                break
            await asyncio.sleep(0.01)
        resp = await api.client.post(CHAT, json=chat(api.model), headers={"X-Request-Timeout": "0.5"})
        assert resp.status_code == 504, resp.text
        assert api.supervisor.states.held == 0  # it left the hold
    finally:
        api.factory.gate.set()


async def test_a_malformed_or_repeated_deadline_is_400(api: Api) -> None:
    loose = ("1_0", "+3", " 5 ", "1e-300", "0x10", "1" + " " * 31 + "junk", "2.")  # hostile review: float() took them
    for value in ("soon", "0", "-1", "nan", "inf", "86401", "1" * 100, *loose):
        resp = await api.client.post(CHAT, json=chat(api.model), headers={"X-Request-Timeout": value})
        assert resp.status_code == 400, (value, resp.text)
        assert "X-Request-Timeout" in resp.json()["error"]["message"]
    twice = [("X-Request-Timeout", "5"), ("X-Request-Timeout", "60")]
    resp = await api.client.post(CHAT, json=chat(api.model), headers=twice)
    assert resp.status_code == 400 and "x-request-timeout" in resp.json()["error"]["message"]


async def test_the_queue_caps_refuse_with_503_before_the_body_is_read(make_api: Any) -> None:
    api: Api = await make_api("--max-num-queued-reqs", "0")
    resp = await api.client.post(CHAT, json=chat(api.model))
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert "--max-num-queued-reqs 0" in resp.json()["error"]["message"]
