"""#34 in-process: a request takes an in-flight slot only once its body has arrived, a body that does not
arrive in time gets 408, and readiness says when the door can admit no more."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from tests.inprocess import Api

CHAT = "/v1/chat/completions"


def body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Is the exit clear?"}], "max_tokens": 2}


async def test_stalled_uploads_hold_no_slot_and_time_out_with_408(make_api: Any) -> None:
    """Before: 1030 connections that sent a POST's headers and never the body held every one of the 1024
    in-flight slots indefinitely; every real request got 429 while /ready stayed 200."""
    api: Api = await make_api("--guard-max-inflight", "2", "--guard-body-timeout", "1")
    raw = json.dumps(body(api.model)).encode()
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield raw[:10]
        await never.wait()  # the rest never comes

    uploads = [
        asyncio.create_task(api.client.post(CHAT, content=stalled(), headers={"content-type": "application/json"}))
        for _ in range(5)
    ]
    resp = await api.client.post(CHAT, json=body(api.model))
    assert resp.status_code == 200, resp.text  # five stalled uploads, two slots: still served
    assert (await api.client.get("/ready")).json()["saturated"] is False
    answers = await asyncio.wait_for(asyncio.gather(*uploads), 30)
    assert [r.status_code for r in answers] == [408] * 5
    assert "not received within 1 s" in answers[0].json()["error"]["message"]


async def test_ready_is_503_while_every_slot_is_taken(make_api: Any) -> None:
    api: Api = await make_api("--guard-max-inflight", "1")
    engine = api.engine
    engine.pause()
    seen = len(engine.requests)
    inside = asyncio.create_task(api.client.post(CHAT, json=body(api.model)))
    try:
        await asyncio.wait_for(engine.wait_for_requests(seen + 1), 30)
        ready = await api.client.get("/ready")
        assert ready.status_code == 503 and ready.json()["saturated"] is True
        refused = await api.client.post(CHAT, json=body(api.model))
        assert refused.status_code == 429 and refused.headers["retry-after"]
    finally:
        engine.resume()
    assert (await inside).status_code == 200
    assert (await api.client.get("/ready")).json()["saturated"] is False
