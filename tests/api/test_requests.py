"""The OpenAI surface in-process (CASES C8-C10): what vlguard and vLLM's serving layer answer before any
engine work, always in the OpenAI error envelope, and that a good request right after still succeeds."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable

import httpx
import pytest

from server.workload.images import data_uri, photo_bytes, photo_uri
from tests.helpers import chat_body, png
from tests.inprocess import Api

KEY = "test-key-0f3a9c1e"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"


def assert_envelope(resp: httpx.Response, status: int, needle: str) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    err: dict[str, object] = resp.json()["error"]
    assert err["code"] == status and needle.lower() in str(err["message"]).lower(), err
    assert set(err) >= {"message", "type", "param", "code"}
    return err


async def test_chat_with_an_image_reaches_the_engine_processed(api: Api) -> None:
    resp = await api.client.post(CHAT, json=chat_body(api.model, photo_uri("astronaut.png"), max_tokens=3))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    prompt = api.engine.prompts[api.engine.requests[-1]]
    assert len(prompt) > 100  # the image's placeholder tokens were expanded by the real processor


async def test_malformed_json_is_400(api: Api) -> None:
    resp = await api.client.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    assert_envelope(resp, 400, "JSON")


async def test_missing_messages_is_400(api: Api) -> None:
    err = assert_envelope(await api.client.post(CHAT, json={"model": api.model}), 400, "messages")
    assert err["param"] == "messages"


async def test_negative_max_tokens_is_400(api: Api) -> None:
    body = {"model": api.model, "max_tokens": -1, "messages": [{"role": "user", "content": "hi"}]}
    assert_envelope(await api.client.post(CHAT, json=body), 400, "max_tokens")


async def test_unknown_model_is_404(api: Api) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    assert_envelope(await api.client.post(CHAT, json=body), 404, "no-such-model")


async def test_prompt_longer_than_max_model_len_is_400(api: Api) -> None:
    body = {"model": api.model, "messages": [{"role": "user", "content": "safety " * 6000}], "max_tokens": 4}
    assert_envelope(await api.client.post(CHAT, json=body), 400, "")


def _corrupt_png() -> bytes:
    data = bytearray(png(64, 64))
    idat = data.index(b"IDAT")
    data[idat + 8 : idat + 24] = b"\xff" * 16  # garbage inside the compressed pixel data
    return bytes(data)


JPEG = photo_bytes("rocket.jpg")
BAD_MEDIA: dict[str, tuple[Callable[[], str], int, str]] = {
    # CASES C8
    "truncated-jpeg": (lambda: data_uri(JPEG[: len(JPEG) // 3], "image/jpeg"), 400, "truncated"),
    "random-bytes-as-png": (lambda: data_uri(bytes(range(256)) * 64, "image/png"), 400, "not a readable image"),
    "invalid-base64": (lambda: "data:image/png;base64,@@not*base64@@", 400, "invalid base64"),
    "empty-data-uri": (lambda: "data:image/png;base64,", 400, "empty data URI"),
    "corrupt-png-chunk": (lambda: data_uri(_corrupt_png(), "image/png"), 400, "image"),
    # limits and policy
    "decompression-bomb": (lambda: data_uri(png(30000, 30000, "1"), "image/png"), 400, "pixels"),
    "extreme-aspect-ratio": (lambda: data_uri(png(1000, 2), "image/png"), 400, "aspect ratio"),
    "remote-url-disabled": (lambda: "http://127.0.0.1:9/cat.png", 400, "remote media URLs are disabled"),
    "file-url": (lambda: "file:///etc/passwd", 400, "local file URLs are refused"),
    "unknown-scheme": (lambda: "ftp://example.invalid/cat.png", 400, "unsupported"),
    "not-base64-uri": (lambda: "data:image/png,rawbytes", 400, "malformed data URI"),
}


@pytest.fixture
async def guarded(make_api: Callable[..., object]) -> Api:
    """An API key and small limits, so every limit is reachable cheaply."""
    flags = ("--api-key", KEY, "--guard-max-inflight", "3", "--guard-max-request-mb", "8",
             "--guard-max-image-pixels", "4000000")  # fmt: skip
    api = await make_api(*flags)  # type: ignore[misc]
    assert isinstance(api, Api)
    return api


async def _chat(api: Api, *urls: str, headers: dict[str, str] | None = None, **extra: object) -> httpx.Response:
    return await api.client.post(
        CHAT, json=chat_body(api.model, *urls, **extra), headers=HEADERS if headers is None else headers
    )


@pytest.mark.parametrize("case", list(BAD_MEDIA))
async def test_bad_media_gets_a_clear_4xx_and_never_reaches_the_engine(guarded: Api, case: str) -> None:
    make, status, words = BAD_MEDIA[case]
    seen = len(guarded.engine.requests)
    assert_envelope(await _chat(guarded, make()), status, words)
    assert len(guarded.engine.requests) == seen
    assert (await _chat(guarded, photo_uri("astronaut.png"))).status_code == 200


async def test_more_images_than_the_limit(guarded: Api) -> None:
    """CASES C9: the tiny profile allows 4 images per prompt."""
    assert_envelope(await _chat(guarded, *[photo_uri("astronaut.png")] * 5), 400, "at most 4")
    assert (await _chat(guarded, photo_uri("astronaut.png"))).status_code == 200


async def test_oversized_body_is_413(guarded: Api) -> None:
    big = "data:image/png;base64," + base64.b64encode(b"\0" * (9 * 1024 * 1024)).decode()
    assert_envelope(await _chat(guarded, big), 413, "larger than")
    assert (await _chat(guarded, photo_uri("astronaut.png"))).status_code == 200


async def test_api_key_and_open_probes(guarded: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert (await _chat(guarded, photo_uri("astronaut.png"), headers={})).status_code == 401
    assert (await _chat(guarded, photo_uri("astronaut.png"), headers={"Authorization": "Bearer no"})).status_code == 401
    assert (await _chat(guarded, photo_uri("astronaut.png"))).status_code == 200
    for probe in ("/health", "/ready", "/metrics"):  # open for the orchestrator and Prometheus
        assert (await guarded.client.get(probe)).status_code == 200, probe
    assert (await guarded.client.get("/v1/models")).status_code == 401
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in logged and "Is anyone wearing a helmet?" not in logged and "base64," not in logged


async def test_past_the_inflight_bound_is_429_with_retry_after(guarded: Api) -> None:
    """3 streams fill --guard-max-inflight 3 (the engine is paused, so none can finish); a 4th request is
    refused at once, not queued; once they finish, requests are admitted again."""
    import asyncio

    guarded.engine.pause()
    seen = len(guarded.engine.requests)

    async def stream() -> int:
        async with guarded.client.stream(
            "POST", CHAT, json=chat_body(guarded.model, stream=True), headers=HEADERS
        ) as r:
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    streams = [asyncio.create_task(stream()) for _ in range(3)]
    await asyncio.wait_for(guarded.engine.wait_for_requests(seen + 3), 10)
    resp = await _chat(guarded, photo_uri("astronaut.png"))
    assert_envelope(resp, 429, "busy")
    assert resp.headers["Retry-After"].isdigit()
    guarded.engine.resume()
    assert await asyncio.wait_for(asyncio.gather(*streams), 10) == [200, 200, 200]
    assert (await _chat(guarded, photo_uri("astronaut.png"))).status_code == 200


async def test_client_errors_raised_by_vllm_are_answered_without_an_app_exception(api: Api) -> None:
    # Starlette re-raises after a catch-all handler's answer: uvicorn then logs a traceback and closes the
    # keep-alive connection. vLLM raises ValueError for an empty conversation (its chat template fails).
    strict = httpx.ASGITransport(app=api.app, raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=strict, base_url="http://vlguard.test") as client:
        resp = await client.post(CHAT, json={"model": api.model, "messages": []})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400


#: A client's mistakes that reached vLLM's serving layer or the engine's input path and came back as a 500
#: or 501 on vLLM 0.20 (#44): the whole kind is the client's 4xx, in the envelope, with a message naming the
#: problem (any one of the needles: later vLLMs refuse some of these themselves, in their own words).
CLIENT_MISTAKES: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "tool without function": (
        {"tools": [{"type": "function"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        ("function",),
    ),
    "tool function a list": ({"tools": [{"type": "function", "function": []}], "tool_choice": "auto"}, ("",)),
    "file part": (
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_data": "aGk="}}]}]},
        ("file",),
    ),
    "input_file part": (
        {"messages": [{"role": "user", "content": [{"type": "input_file", "file_data": "aGk="}]}]},
        ("",),
    ),
    "vllm_xargs beyond 64 bits": ({"vllm_xargs": {"k": 2**70}}, ("OverflowError", "2**64")),
    "vllm_xargs nested beyond 64 bits": ({"vllm_xargs": {"k": [1, -(2**64)]}}, ("OverflowError", "2**63")),
}


def assert_client_error(resp: httpx.Response, needles: tuple[str, ...]) -> None:
    """A 4xx in the OpenAI envelope whose message holds one of ``needles``."""
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert err["code"] == resp.status_code and set(err) >= {"message", "type", "param", "code"}, err
    assert any(n.lower() in str(err["message"]).lower() for n in needles), err


@pytest.mark.parametrize("case", CLIENT_MISTAKES)
async def test_a_clients_mistake_is_a_4xx_never_a_5xx(api: Api, case: str) -> None:
    extra, needles = CLIENT_MISTAKES[case]
    body = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    assert_client_error(await api.client.post(CHAT, json=body), needles)
    good = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await api.client.post(CHAT, json=good)).status_code == 200


async def test_a_stream_the_engine_cannot_take_is_a_400_before_its_200(api: Api) -> None:
    """CASES C24: a stream's response starts before vLLM 0.20's engine client sees the request, and the
    refusal came as its first event under a 200; it is now the plain 400 the unstreamed request gets (later
    vLLMs refuse this value before the stream starts themselves)."""
    body = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "vllm_xargs": {"k": 2**70}}  # fmt: skip
    async with api.client.stream("POST", CHAT, json=body) as resp:
        await resp.aread()
    assert_client_error(resp, ("2**64",))


UNRENDERABLE = [{"type": "item_reference", "id": "x"}, {"type": "reasoning", "id": "r", "summary": []}]


@pytest.mark.parametrize("item", UNRENDERABLE)
async def test_a_responses_item_vllm_cannot_render_is_never_a_5xx(api: Api, item: dict[str, object]) -> None:
    """#44: vLLM 0.20's serving layer reads a Responses input item's ``role`` unchecked (500 ``'role'``, a
    KeyError while rendering, after the body parsed): raised before the request reached the engine client,
    it is the client's 400 and the engine never sees it. (vLLM 0.22+ refuse an ``item_reference`` in their
    own words and render a ``reasoning`` item: 200.)"""
    seen = len(api.engine.requests)
    resp = await api.client.post("/v1/responses", json={"model": api.model, "input": [item], "max_output_tokens": 4})
    assert resp.status_code < 500, resp.text
    if resp.status_code != 200:
        assert_client_error(resp, ("role", "input item"))
        assert len(api.engine.requests) == seen
    good = {"model": api.model, "input": "Is the exit clear?", "max_output_tokens": 2}
    assert (await api.client.post("/v1/responses", json=good)).status_code == 200


async def test_a_clients_long_string_is_cut_in_the_log(api: Api) -> None:
    """Hostile review: vLLM logs an unknown ``model`` whole, so one request made a 5 MB ERROR line (the event
    loop held 115 ms writing it). Every handler of vLLM's, vlguard's and uvicorn's loggers now cuts a message
    to 8192 characters, saying how much was cut. (A 5 MB ``model`` is now refused at the door: the fields
    beside the input hold at most 64 KiB of text; 60,000 characters still reach vLLM's log.)"""
    import io
    import logging

    from server.api.errors import MAX_LOG_CHARS, LongMessageCut

    vllm_log = logging.getLogger("vllm")
    assert vllm_log.handlers and all(any(isinstance(f, LongMessageCut) for f in h.filters) for h in vllm_log.handlers)
    written = io.StringIO()
    capture = logging.StreamHandler(written)  # written as vLLM's own handler writes
    capture.filters = list(vllm_log.handlers[0].filters)
    vllm_log.addHandler(capture)
    body = {"model": "m" * 60_000, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        resp = await api.client.post("/v1/chat/completions", json=body)
    finally:
        vllm_log.removeHandler(capture)
    assert resp.status_code == 404, resp.text[:200]
    assert "more characters cut" in written.getvalue(), written.getvalue()[:300]
    assert len(written.getvalue()) < 2 * MAX_LOG_CHARS
