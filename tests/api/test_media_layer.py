"""#44: every media item meets the media policy inside vLLM's media layer, whatever shape carried it.

The shapes here are ones the door's JSON walk does not read (a Responses ``function_call_output`` item's
``output`` list); the policy holds anyway, because vLLM loads every media item through the connector vlguard
registers (:mod:`server.vllm_hooks.media_connector`). In-process, over vLLM's real serving layer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections.abc import AsyncIterator
from typing import Any

import pytest
from PIL import Image

from tests.helpers import png
from tests.inprocess import Api


def _uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _large_png(width: int, height: int) -> bytes:
    """A bilevel PNG of ``width x height``: a few kB, however many pixels it says it has."""
    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def tool_output_body(model: str, *parts: dict[str, Any]) -> dict[str, Any]:
    """A Responses request whose media sits in a ``function_call_output`` item (a shape the door does not walk)."""
    return {
        "model": model,
        "max_output_tokens": 2,
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "seen:"}, *parts],
            },
            {"role": "user", "content": "Is anyone wearing a helmet?"},
        ],
    }


@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP listener on loopback: ``(port, connections)``; ``connections`` grows by one per connection."""
    seen: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(1)
        writer.close()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


def assert_refused(resp: Any, *words: str) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert all(w in error["message"] for w in words), error


async def test_a_remote_url_in_a_tool_output_reaches_no_listener(api: Api) -> None:
    """Remote media off (the default): the URL is refused before any connection; the answer does not tell
    an open port from a closed one."""
    answers = []
    async with listener() as (port, connections):
        for url in (f"http://127.0.0.1:{port}/x.png", "http://127.0.0.1:1/x.png"):
            part = {"type": "input_image", "image_url": url, "detail": "auto"}
            resp = await api.client.post("/v1/responses", json=tool_output_body(api.model, part))
            assert_refused(resp, "remote media")
            answers.append(resp.json()["error"]["message"])
        assert connections == []
    assert answers[0] == answers[1]


@pytest.mark.parametrize("scheme", ["ftp://127.0.0.1/x.png", "gopher://127.0.0.1:70/x", "file:///etc/hostname"])
async def test_other_schemes_in_a_tool_output_are_refused(api: Api, scheme: str) -> None:
    part = {"type": "input_image", "image_url": scheme, "detail": "auto"}
    resp = await api.client.post("/v1/responses", json=tool_output_body(api.model, part))
    assert_refused(resp)


async def test_an_oversized_image_in_a_tool_output_is_refused_from_its_header(api: Api) -> None:
    part = {"type": "input_image", "image_url": _uri(_large_png(12000, 12000)), "detail": "auto"}
    resp = await api.client.post("/v1/responses", json=tool_output_body(api.model, part))
    assert_refused(resp, "144000000 pixels")


async def test_an_image_in_a_tool_output_within_the_bounds_passes_the_media_layer(api: Api) -> None:
    """Loaded (vLLM 0.20's Responses conversion then drops a tool output's image from the prompt: a 400 of
    the prompt's, not the media's); never a 5xx."""
    part = {"type": "input_image", "image_url": _uri(png(64, 48)), "detail": "auto"}
    resp = await api.client.post("/v1/responses", json=tool_output_body(api.model, part))
    assert resp.status_code < 500, resp.text[:300]
    if resp.status_code != 200:
        assert "image:" not in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"video": {"num_frames": -1}},
        {"video": {"num_frames": 10_000}},
        {"video": {"video_backend": "opencv_dynamic"}},
        {"video": {"fps": 1e9}},
        {"image": {"image_mode": "I;16"}},
    ],
)
async def test_per_request_media_io_kwargs_are_bounded(api: Api, kwargs: dict[str, Any]) -> None:
    body = {
        "model": api.model,
        "max_tokens": 2,
        "media_io_kwargs": kwargs,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _uri(png(32, 32))}}]}],
    }
    resp = await api.client.post("/v1/chat/completions", json=body)
    assert_refused(resp, "media_io_kwargs")


async def test_allowed_media_io_kwargs_are_served(api: Api) -> None:
    body = {
        "model": api.model,
        "max_tokens": 2,
        "media_io_kwargs": {"video": {"num_frames": 8}},
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _uri(png(32, 32))}}]}],
    }
    resp = await api.client.post("/v1/chat/completions", json=body)
    if resp.status_code == 400:  # vLLM 0.32 on take no per-request media_io_kwargs without a flag of theirs
        assert "--trust-request-mm-kwargs" in resp.json()["error"]["message"]
        return
    assert resp.status_code == 200, resp.text[:300]


def _jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, "JPEG")
    return buf.getvalue()


async def test_video_frames_meet_the_image_bounds_and_the_frame_bound(api: Api) -> None:
    """vLLM's own connector entry points (the tiny profile serves no video, so the connector is called as
    vLLM's parser calls it): each ``video/jpeg`` frame is checked as an image, before it is decoded, and
    the frames decoded are bounded."""
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    connector = MEDIA_CONNECTOR_REGISTRY.load("http", media_io_kwargs={"video": {"num_frames": 4}})
    small = base64.b64encode(_jpeg(32, 32)).decode()
    frames, _ = await connector.fetch_video_async(f"data:video/jpeg;base64,{small},{small}")
    assert len(frames) == 2
    huge = base64.b64encode(_large_png(9000, 9000)).decode()  # PNG inside a JPEG list: read by its header
    with pytest.raises(ValueError, match="video frame: image is 9000x9000"):
        await connector.fetch_video_async(f"data:video/jpeg;base64,{small},{huge}")
    many = MEDIA_CONNECTOR_REGISTRY.load("http", media_io_kwargs={"video": {"num_frames": 32}})
    frames, _ = await many.fetch_video_async("data:video/jpeg;base64," + ",".join([small] * 40))
    assert len(frames) == 32  # the frames decoded: at most the bound (a request cannot ask for more)
    with pytest.raises(ValueError, match="remote media"):
        await connector.fetch_video_async("http://127.0.0.1:1/v.mp4")


async def test_a_videos_frames_together_are_bounded(make_api: Any) -> None:
    """#61: each frame alone may be as large as an image; 12 frames of 7000x7000 took 5.3 GB. A video's
    frames together hold at most twice the largest image's pixels (here 1 MP: frames of 1 MP, the third
    refused before it is decoded)."""
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    await make_api("--guard-max-image-pixels", "1000000")
    connector = MEDIA_CONNECTOR_REGISTRY.load("http", media_io_kwargs={"video": {"num_frames": 8}})
    frame = base64.b64encode(_large_png(1000, 1000)).decode()
    frames, _ = await connector.fetch_video_async(f"data:video/jpeg;base64,{frame},{frame}")
    assert len(frames) == 2
    with pytest.raises(ValueError, match="frames hold 3000000 pixels together, more than the limit of 2000000"):
        await connector.fetch_video_async(f"data:video/jpeg;base64,{frame},{frame},{frame}")
    frames, _ = await connector.fetch_video_async(f"data:video/jpeg;base64,{frame},{frame}")  # counted per video
    assert len(frames) == 2


async def _named(self: Any) -> Any:
    return {"image": ["img"]}, {"image": ["client-uuid"]}


def _named_sync(self: Any) -> Any:
    return {"image": ["img"]}, {"image": ["client-uuid"]}


async def test_client_uuids_are_forgotten_whatever_shape_carried_them(api: Api) -> None:
    """vLLM's item trackers (sync and async, where every shape's media items end up) are hooked to answer
    no uuids: vLLM then hashes the content (vllm#55547)."""
    from server.vllm_hooks import MARK
    from server.vllm_hooks.locations import ITEM_TRACKER_MODULES, ITEM_TRACKERS, _import_if_present
    from server.vllm_hooks.media_connector import _forget_uuids

    modules = [m for name in ITEM_TRACKER_MODULES if (m := _import_if_present(name)) is not None]
    module = next(m for m in modules if all(hasattr(m, c) for c in ITEM_TRACKERS))
    for cls in ITEM_TRACKERS:
        assert getattr(getattr(module, cls).resolve_items, MARK, False), cls
    assert await _forget_uuids(_named)(object()) == ({"image": ["img"]}, {"image": [None]})
    assert _forget_uuids(_named_sync)(object()) == ({"image": ["img"]}, {"image": [None]})


@pytest.mark.parametrize("flag", [(), ("--log-error-stack",)])
async def test_a_client_error_on_vllms_anthropic_route_is_one_log_line(make_api: Any, flag: tuple[str, ...]) -> None:
    """vLLM's Anthropic route logs every exception with its traceback (60 lines) before answering 500, which
    vlguard answers 400: a client sending refused images made the server write 60 lines a request. A client's
    error (raised before the request reached the engine client) is logged in one line, without the stack,
    unless the operator asked for every error's stack."""
    import logging

    api = await make_api(*flag)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    router = logging.getLogger("vllm.entrypoints.anthropic.api_router")
    router.addHandler(handler)
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
    image = {"type": "image", "source": {"type": "url", "url": corrupt}}
    body = {"model": api.model, "max_tokens": 2, "messages": [{"role": "user", "content": [image]}]}
    try:
        resp = await api.client.post("/v1/messages", json=body)
    finally:
        router.removeHandler(handler)
    assert resp.status_code == 400, resp.text[:300]
    assert records and "image" in records[0].getMessage()
    quiet = [r.exc_info is None and r.levelno < logging.ERROR for r in records]
    assert quiet == [not flag] * len(records), [(r.levelname, r.getMessage(), r.exc_info) for r in records]


async def test_a_server_fault_past_the_engine_client_on_the_anthropic_route_stays_5xx(api: Api) -> None:
    """vLLM runs the Anthropic route's handler in a task of its own (``with_cancellation``: a copy of the
    request's context), so the engine client's mark that the request had reached it was lost to the request
    task that turns the route's 500s for a client's bad input into 400: a server fault past the engine
    client was answered 400 ``invalid_request_error``, as if the client's."""

    async def faulting(prompt: Any, sampling_params: Any, request_id: str, **_: Any) -> Any:
        raise RuntimeError("vlguard test: a server fault inside the engine")
        yield  # an async generator, as AsyncLLM.generate

    api.engine.generate = faulting  # type: ignore[method-assign]
    body = {"model": api.model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}
    resp = await api.client.post("/v1/messages", json=body)
    assert resp.status_code >= 500, resp.text[:300]


@pytest.mark.parametrize("cache_mb", ["256", "0"])
async def test_an_image_sent_again_is_not_decoded_again(make_api: Any, cache_mb: str) -> None:
    """The two-pass workload through vLLM's media layer: the rescue prompt's image (the same bytes as the
    primary's) is a copy of the first decode, not a second decode (``--guard-image-cache-mb 0``: decoded
    again, as stock); the engine is given the same prompt either way. A vLLM that charges each request's
    decoded bytes to a budget of the request's own (0.34) is never served from the cache: a hit would skip
    the charge."""
    from server.metrics import definitions as m
    from server.vllm_hooks.locations import upstream_decode_budget

    kept = 1 if cache_mb != "0" and not upstream_decode_budget() else 0

    api = await make_api("--guard-image-cache-mb", cache_mb)
    image = {"type": "image_url", "image_url": {"url": _uri(png(96, 64, "RGB"))}}
    hits = m.IMAGE_CACHE_LOADS.labels(result="hit")._value.get()
    prompts = []
    for question in ("Is anyone wearing a helmet?", "Is anyone wearing a helmet?"):
        body = {"model": api.model, "max_tokens": 2,
                "messages": [{"role": "user", "content": [image, {"type": "text", "text": question}]}]}  # fmt: skip
        resp = await api.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text[:300]
        prompts.append(api.engine.prompts[api.engine.requests[-1]])
    assert m.IMAGE_CACHE_LOADS.labels(result="hit")._value.get() - hits == kept
    assert len(api.app.state.media.image_cache) == kept
    assert prompts[0] == prompts[1]
