"""Field inputs (issue #17) in-process, through vLLM's real processor on the tiny model: images reach the
engine as viewers show them, per-request resolution stays within the server's bounds, and no request
shape gets a 500 from vlguard's own error handling. The real-server rows are in
tests/integration/test_field_inputs.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from server.workload.images import data_uri
from tests.api.test_requests import assert_envelope
from tests.helpers import chat_body, field_images, png
from tests.inprocess import Api, serve_args

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
FIELD = field_images()


def engine_pixels(api: Api) -> torch.Tensor:
    """The processed ``pixel_values`` of the last request's first image, as the engine core got them."""
    inputs = api.engine.inputs[api.engine.requests[-1]]
    item = inputs["mm_kwargs"]["image"][0]["pixel_values"]
    return getattr(item, "data", item)


async def pixels_for(api: Api, image: bytes) -> torch.Tensor:
    resp = await api.client.post(CHAT, json=chat_body(api.model, data_uri(image, "image/png"), max_tokens=1))
    assert resp.status_code == 200, resp.text
    return engine_pixels(api)


@pytest.mark.parametrize("row", sorted(FIELD))
async def test_field_images_reach_the_engine_as_viewers_show_them(api: Api, row: str) -> None:
    sent, shown, stock = FIELD[row]
    got = await pixels_for(api, sent)
    assert torch.equal(got, await pixels_for(api, shown)), f"{row}: the engine did not get the picture people see"
    assert not torch.equal(got, await pixels_for(api, stock))  # the test can tell the two apart


def _responses(model: str, uri: str) -> dict[str, Any]:
    image = {"type": "input_image", "image_url": uri, "detail": "auto"}
    return {"model": model, "max_output_tokens": 1, "input": [{"role": "user", "content": [image]}]}


def _messages(model: str, uri: str) -> dict[str, Any]:
    mime, data = uri.removeprefix("data:").split(";base64,")
    image = {"type": "image", "source": {"type": "base64", "media_type": mime, "data": data}}
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [image]}]}


#: Routes and request shapes an image reaches the engine by (the chat route: pixels_for).
SHAPES = {RESPONSES: _responses, "/v1/messages": _messages}


@pytest.mark.parametrize("path", sorted(SHAPES))
async def test_images_are_normalised_on_every_route_as_on_chat(api: Api, path: str) -> None:
    """Normalisation happens where vLLM loads an image, so every route and part shape gets it: until it
    moved there from the door, which reads chat and Responses message parts only, an Anthropic image
    reached the engine as vLLM alone converts it (a rotated photo on its side)."""
    for row, (sent, shown, _) in sorted(FIELD.items()):
        resp = await api.client.post(path, json=SHAPES[path](api.model, data_uri(sent, "image/png")))
        assert resp.status_code == 200, (row, resp.text[:300])
        assert torch.equal(engine_pixels(api), await pixels_for(api, shown)), f"{path} {row}: not what people see"


#: The pixels.py rule each field row exercises.
RULES = {"exif-jpeg": "orientation", "palette-trns": "transparency", "grey16": "bit-depth"}


async def test_normalisation_off_is_stock_behaviour(make_api: Callable[..., Any]) -> None:
    from server.vllm_hooks.locations import upstream_image_rules

    api: Api = await make_api("--guard-image-normalize", "off")
    for row, (sent, shown, stock) in FIELD.items():
        # vLLM 0.32 applies EXIF orientation and transparency itself; older lanes do neither
        vllm_sees = shown if RULES[row] in upstream_image_rules() else stock
        assert torch.equal(await pixels_for(api, sent), await pixels_for(api, vllm_sees)), row


def _image_tokens(api: Api) -> int:
    inputs = api.engine.inputs[api.engine.requests[-1]]
    return sum(p.length for p in inputs["mm_placeholders"]["image"])


async def test_a_request_may_lower_the_resolution(api: Api) -> None:
    image = data_uri(png(256, 256), "image/png")
    assert (await api.client.post(CHAT, json=chat_body(api.model, image))).status_code == 200
    full = _image_tokens(api)
    body = chat_body(api.model, image, mm_processor_kwargs={"max_pixels": 64 * 64})
    resp = await api.client.post(CHAT, json=body)
    if getattr(serve_args(api.model)[0], "trust_request_mm_kwargs", None) is False:
        # vLLM 0.32 refuses every per-request mm_processor_kwargs unless --trust-request-mm-kwargs
        assert_envelope(resp, 400, "trust-request-mm-kwargs")
        return
    assert resp.status_code == 200, resp.text
    assert _image_tokens(api) < full


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"min_pixels": 10**9}, "processed image bound of 262144"),  # the tiny model's max_pixels
        ({"max_pixels": 10**9}, "processed image bound"),
        ({"size": {"shortest_edge": 10**9, "longest_edge": 10**9}}, "processed image bound"),
        ({"patch_size": 2}, "may not be set per request"),
    ],
)
async def test_a_request_may_not_raise_it(api: Api, kwargs: dict[str, Any], needle: str) -> None:
    body = chat_body(api.model, data_uri(png(64, 64), "image/png"), mm_processor_kwargs=kwargs)
    assert_envelope(await api.client.post(CHAT, json=body), 400, needle)
    assert [r for r in api.engine.requests if "probe" not in r] == []  # refused before any pixel work


async def test_completions_max_tokens_null_means_the_default(api: Api) -> None:
    # As vLLM 0.32 decides it (and the OpenAI reference: "Defaults to 16"); 0.20 and 0.22 answered 500.
    for extra in ({}, {"echo": True}, {"stream": True}):
        body = {"model": api.model, "prompt": "safety check", "max_tokens": None, **extra}
        resp = await api.client.post(COMPLETIONS, json=body)
        assert resp.status_code == 200, (extra, resp.text)
        if not extra.get("stream"):
            assert resp.json()["usage"]["completion_tokens"] == 16


CONTENT_TYPES = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=utf-8", "APPLICATION/JSON", "application/json-patch+json",
                 "image/png", "", ";;;", "application/json; charset=latin-1",
                 "application/json, text/plain"]  # fmt: skip
BODIES = [b"", b"\xff\xfe\x00", b"[]", b"null", b'"text"', b"123", b'{"messages": "x"}', b'{"model": {"a": 1}}',
          b"[" * 5000 + b"]" * 5000, b'{"model": "m", "messages": [{"role": "user", "content": [{"type": 7}]}]}',
          b'{"model": "m", "prompt": [[1, "a"]], "max_tokens": "x"}', b'{"input": {"bad": true}}',
          b'{"model": "m", "messages": ' + b"[" * 300 + b"]" * 300 + b"}",  # the door's fast parser refuses this depth,
          b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate
          '{"model": "m", "messages": []}'.encode("utf-16")]  # fmt: skip


async def test_no_content_type_or_body_shape_gets_a_500(api: Api) -> None:
    valid = chat_body(api.model, max_tokens=1)
    seen: set[int] = set()
    for path, ctype, body in itertools.product((CHAT, COMPLETIONS, RESPONSES), CONTENT_TYPES, BODIES):
        headers = {} if ctype is None else {"content-type": ctype}
        resp = await api.client.post(path, content=body, headers=headers)
        assert resp.status_code < 500, (path, ctype, body[:40], resp.text)
        if resp.status_code >= 400:
            assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}
        seen.add(resp.status_code)
    for ctype in (None, "text/plain"):  # the CASES row: a valid body without a JSON content type
        headers = {} if ctype is None else {"content-type": ctype}
        resp = await api.client.post(CHAT, content=httpx.Request("POST", "/", json=valid).content, headers=headers)
        assert_envelope(resp, 400, "application/json")
    assert (await api.client.post(CHAT, json=valid)).status_code == 200  # nothing else lost
    assert 400 in seen


async def test_header_shapes_do_not_get_a_500(api: Api) -> None:
    raw = httpx.Request("POST", "/", json=chat_body(api.model, max_tokens=1)).content
    shapes: list[list[tuple[bytes, bytes]]] = [
        [(b"content-type", b"application/json"), (b"content-type", b"text/plain")],
        [(b"content-type", b"application/json; " + b"x" * 8000)],
        [(b"content-type", "application/jsön".encode())],
        [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")],
        [(b"content-type", b"application/json"), (b"authorization", b"Bearer")],
    ]
    for headers in shapes:
        resp = await api.client.post(CHAT, content=raw, headers=headers)
        assert resp.status_code < 500, (headers, resp.text)


async def test_tokenize_gets_the_same_checks(api: Api) -> None:
    # /tokenize runs the image processor in the API process: its mm_processor_kwargs and images are bounded too.
    body = chat_body(api.model, data_uri(png(64, 64), "image/png"), mm_processor_kwargs={"min_pixels": 10**10})
    assert_envelope(await api.client.post("/tokenize", json=body), 400, "processed image bound")
    body = chat_body(api.model, data_uri(png(64, 64), "image/png"))
    assert (await api.client.post("/tokenize", json=body)).status_code == 200


async def test_the_door_holds_under_a_root_path(make_api: Callable[..., Any]) -> None:
    api: Api = await make_api("--root-path", "/api")
    bomb = chat_body(api.model, data_uri(png(8000, 8000), "image/png"))  # 64 MP: above the 50 MP limit
    assert_envelope(await api.client.post("/api" + CHAT, json=bomb), 400, "pixels")
    good = chat_body(api.model, data_uri(png(64, 64), "image/png"))
    assert (await api.client.post("/api" + CHAT, json=good)).status_code == 200
