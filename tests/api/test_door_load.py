"""#34 in-process: a request takes an in-flight slot only once its body has arrived, a body that does not
arrive in time gets 408, and readiness says when the door can admit no more."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

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


async def test_post_routes_the_door_does_not_check_are_refused(api: Api) -> None:
    """#34: vLLM's batch route took messages past every check (a remote URL fetched by vLLM itself, a
    56-megapixel PNG, a 70 MB body). Deny by default: a POST route the input guard does not check is 404,
    and the routes known to take no input still work."""
    batch = {"model": api.model, "messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 2}
    resp = await api.client.post("/v1/chat/completions/batch", json=batch)
    assert resp.status_code == 404 and "past the per-request bounds" in resp.json()["error"]["message"]
    resp = await api.client.post("/v1/anything/new", json={})
    assert resp.status_code == 404 and "does not know this route" in resp.json()["error"]["message"]
    assert (await api.client.post("/detokenize", json={"model": api.model, "tokens": [1, 2]})).status_code == 200


async def test_part_shapes_are_read_as_vllm_reads_them(api: Api) -> None:
    """#34: a part with no ``type`` holding a ``video_url`` is read by vLLM's parser as a video, and a part
    with a ``uuid`` by its keys whatever its type; the door reads them the same way (here: a remote URL,
    refused with remote media off, which vLLM had fetched itself)."""
    url = "http://127.0.0.1:9/x.png"
    seen = len(api.engine.requests)

    async def post(part: dict[str, Any]) -> Any:
        msg = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}]
        return await api.client.post(CHAT, json={"model": api.model, "messages": msg, "max_tokens": 2})

    for part in (
        {"video_url": {"url": url}},  # no type: vLLM reads the video
        {"image_url": {"url": url}, "uuid": None},  # no type, a null uuid
        {"type": "image_embeds", "image_embeds": "AAAA"},  # raw tensors: nothing to check
    ):
        resp = await post(part)
        assert resp.status_code == 400, (part, resp.text)
    assert len(api.engine.requests) == seen
    # A text part with a uuid and an image_url: the uuid is dropped at the door, so vLLM reads it as the
    # text it says it is and never fetches the URL.
    resp = await post({"type": "text", "text": "hi", "uuid": "u-1", "image_url": {"url": url}})
    assert resp.status_code == 200 and len(api.engine.prompts[api.engine.requests[-1]]) < 40


async def test_a_client_uuid_never_stands_for_content(api: Api) -> None:
    """#34 (vllm#55547): the same uuid with another image is answered about that image (the uuid is
    dropped, vLLM hashes the content), and a uuid without the image is refused."""
    from server.workload.images import photo_uri

    def chat(image: str | None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "image_url", "uuid": "shared-uuid"}
        part["image_url"] = {"url": image} if image else None
        content = [{"type": "text", "text": "What is it?"}, part]
        return {"model": api.model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}

    prompts = []
    for photo in ("coffee.png", "astronaut.png"):
        assert (await api.client.post(CHAT, json=chat(photo_uri(photo)))).status_code == 200
        prompts.append(api.engine.prompts[api.engine.requests[-1]])
    assert prompts[0] != prompts[1]  # two pictures, two prompts: the second was not taken for the first
    refused = await api.client.post(CHAT, json=chat(None))
    assert refused.status_code == 400 and "uuid without the media" in refused.json()["error"]["message"]


def client_from(api: Api, host: str) -> httpx.AsyncClient:
    """A client of the same in-process app seen from ``host`` (the ASGI scope's client address)."""
    transport = httpx.ASGITransport(app=api.app, raise_app_exceptions=False, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://vlguard.test", timeout=30)


async def test_one_clients_stalled_uploads_never_refuse_another_nor_turn_ready_503(make_api: Any) -> None:
    """#44: ten stalled uploads that filled the body budget turned /ready 503 and refused every client's
    request with 429. Now one client's bodies hold at most its share (a quarter of the budget): its next
    upload gets 429 naming the client's limit, another client is served, /ready stays 200, and the share
    is given back when the stalled uploads time out. A body larger than the share is 413 for an identified
    client. (IPv6 clients share one identity per /64.)"""
    api: Api = await make_api("--guard-max-body-memory-mb", "1", "--guard-body-timeout", "2")
    chunk = b"x" * 100_000
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "messages": [], "pad": "' + chunk
        await never.wait()

    headers = {"content-type": "application/json"}
    async with client_from(api, "198.51.100.7") as mallory, client_from(api, "2001:db8::1") as alice, \
            client_from(api, "2001:db8::2") as alice_too:  # fmt: skip
        assert (await api.client.get("/ready")).status_code == 200  # the middleware stack is built
        guard = api.app.state.input_guard
        uploads = [asyncio.create_task(mallory.post(CHAT, content=stalled(), headers=headers)) for _ in range(2)]
        deadline = asyncio.get_running_loop().time() + 30
        while guard.client_bytes.get("addr:198.51.100.7", 0) < 200_000:  # both uploads have sent their chunk
            assert asyncio.get_running_loop().time() < deadline, "the uploads never arrived"
            await asyncio.sleep(0.01)
        third = await mallory.post(CHAT, content=b'{"pad": "' + chunk + b'"}', headers=headers)
        assert third.status_code == 429 and "limit 262144 per client" in third.json()["error"]["message"]
        assert third.headers["retry-after"]
        assert (await alice.post(CHAT, json=body(api.model))).status_code == 200  # another client is served
        assert (await api.client.get("/ready")).status_code == 200  # not saturated by one client
        big = await alice_too.post(CHAT, json={**body(api.model), "pad": "y" * 300_000})
        assert big.status_code == 413 and "262144" in big.text  # larger than a client's share
        assert [r.status_code for r in await asyncio.wait_for(asyncio.gather(*uploads), 30)] == [408, 408]
        assert guard.client_bytes == {} and guard.body_bytes == 0  # given back
        assert (await mallory.post(CHAT, json=body(api.model))).status_code == 200


async def test_a_route_without_inputs_to_check_still_has_its_body_bounded(make_api: Any) -> None:
    """#44: /detokenize took a 66 MiB body (200 after 30 s, +3 GB) and a stalled upload there never timed
    out: every POST body is now bounded in size, time and budget, whatever the route; only its checks
    differ (a list of token ids has no media)."""
    api: Api = await make_api("--guard-max-request-mb", "1", "--guard-body-timeout", "1")
    big = {"model": api.model, "tokens": [1] * 600_000}  # ~1.8 MB of JSON
    resp = await api.client.post("/detokenize", json=big)
    assert resp.status_code == 413 and "larger than" in resp.json()["error"]["message"], resp.text
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "tokens": [1, 2'
        await never.wait()

    stalled_upload = await asyncio.wait_for(
        api.client.post("/detokenize", content=stalled(), headers={"content-type": "application/json"}), 30
    )
    assert stalled_upload.status_code == 408
    ok = await api.client.post("/detokenize", json={"model": api.model, "tokens": [1, 2]})
    assert ok.status_code == 200 and "prompt" in ok.json()


async def test_one_clients_requests_never_take_every_in_flight_slot(make_api: Any) -> None:
    """Hostile review of #44: slow readers of one client held in-flight slots indefinitely, and every slot
    could be one client's. Now one client holds at most its share of --guard-max-inflight (4 x 0.5 = 2): its
    next request gets 429 naming the per-client limit while another client is served and /ready stays 200."""
    api: Api = await make_api("--guard-max-inflight", "4", "--guard-inflight-share", "0.5")
    engine = api.engine
    engine.pause()
    seen = len(engine.requests)
    async with client_from(api, "203.0.113.7") as greedy, client_from(api, "198.51.100.9") as other:
        inside = [asyncio.create_task(greedy.post(CHAT, json=body(api.model))) for _ in range(2)]
        try:
            await asyncio.wait_for(engine.wait_for_requests(seen + 2), 30)
            refused = await greedy.post(CHAT, json=body(api.model))
            assert refused.status_code == 429 and "per client" in refused.json()["error"]["message"]
            assert (await api.client.get("/ready")).status_code == 200
            served = asyncio.create_task(other.post(CHAT, json=body(api.model)))
            await asyncio.wait_for(engine.wait_for_requests(seen + 3), 30)
        finally:
            engine.resume()
        assert [(await t).status_code for t in (*inside, served)] == [200, 200, 200]
        assert (await greedy.post(CHAT, json=body(api.model))).status_code == 200  # its share given back
