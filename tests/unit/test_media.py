"""The media checks on request bodies (pure)."""

from __future__ import annotations

import base64
import dataclasses
import io
from http import HTTPStatus

import pytest
from PIL import Image

from server.api.media import (
    MediaError,
    MediaLimits,
    PixelBounds,
    check_media,
    count_items,
    media_parts,
    normalized_image,
    requested_pixel_bounds,
    server_pixel_bounds,
)

LIMITS = MediaLimits(max_image_bytes=1 << 20, max_image_pixels=1_000_000, max_aspect_ratio=200,
                     remote_media=False, local_media=False)  # fmt: skip


def _png(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(*parts: dict[str, object]) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": list(parts)}]}


def test_parts_are_found_in_chat_and_responses_bodies() -> None:
    chat = _chat({"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:a"}})
    assert [p.where for p in media_parts(chat)] == ["messages[1].content[1]"]
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}
    [part] = media_parts(responses)
    assert (part.where, part.kind, part.url) == ("input[0].content[0]", "input_image", "http://x/y.png")
    part.replace("data:image/png;base64,AAAA")  # a plain-string URL is rewritten where it was
    assert responses["input"][0]["content"][0]["image_url"] == "data:image/png;base64,AAAA"
    audio = _chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    assert next(iter(media_parts(audio))).url == "data:audio/wav;base64,AAAA"


def test_parts_are_found_as_vllm_reads_them() -> None:
    bomb = _png(2000, 1000)
    odd = [{"type": ["image_url"]}, {"type": {"k": 1}}, {"type": None}, "text", 7]  # not media, no crash
    assert list(media_parts(_chat(*odd))) == []
    for part in ({"image_url": bomb}, {"image_url": {"url": bomb}}, {"type": "text", "uuid": "u1", "image_url": bomb}):
        with pytest.raises(MediaError, match="pixels"):  # vLLM reads these as images: so does the door
            check_media(_chat(part), LIMITS)


def test_a_good_image_passes_and_counts() -> None:
    body = _chat({"type": "image_url", "image_url": {"url": _png(64, 48)}})
    assert check_media(body, LIMITS) == (1, ())
    assert check_media(body, dataclasses.replace(LIMITS, normalize=True)) == (1, ())  # RGB: nothing to do


def test_an_image_to_normalise_is_found_from_its_header_and_left_alone() -> None:
    """``check_media`` decodes no pixels: an image a rule applies to (here: grey with alpha, composited on
    white) comes back as pending, with its pixel count for the decode pool's budget; the body is unchanged."""
    buf = io.BytesIO()
    Image.new("LA", (8, 6)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = _chat({"type": "image_url", "image_url": {"url": url}})
    limits = dataclasses.replace(LIMITS, normalize=True)
    checked = check_media(body, limits)
    [pending] = checked.pending
    assert (checked.parts, pending.pixels, pending.data, pending.part.url) == (1, 48, buf.getvalue(), url)
    assert next(iter(media_parts(body))).url == url
    png = normalized_image(pending.part.where, pending.data, limits)
    assert png is not None and Image.open(io.BytesIO(png)).mode == "RGB"
    with pytest.raises(MediaError, match="pixels cannot be decoded"):
        normalized_image("x", b"not an image", limits)  # what Pillow cannot decode: 400, not a 500
    with pytest.raises(MediaError, match="pixels"):  # the checks themselves still run without decoding
        check_media(_chat({"type": "image_url", "image_url": {"url": _png(2000, 1000)}}), limits)


def test_items_are_counted_per_modality_before_anything_is_decoded() -> None:
    """vLLM counts items per modality for ``--limit-mm-per-prompt``, untyped parts included; the door
    refuses more before decoding: a part that is not even valid base64 is never looked at."""
    junk = {"type": "image_url", "image_url": {"url": "data:image/png;base64,****"}}
    body = _chat(junk, {"image_url": "data:x"}, {"type": "input_image", "image_url": "data:y"})
    assert count_items(body, {"image": 3}) == {"image": 3}
    with pytest.raises(MediaError, match=r"At most 2 image\(s\) may be provided in one prompt; this request has 3"):
        check_media(body, LIMITS, item_limits={"image": 2})
    with pytest.raises(MediaError, match=r"At most 0 video"):
        count_items(_chat({"video_url": {"url": "data:v"}}), {"image": 4, "video": 0})
    assert count_items(_chat({"type": "text", "text": "hi"}), {"image": 0}) == {}  # nothing to count
    with pytest.raises(MediaError, match="invalid base64"):  # within the limit: checked as before
        check_media(body, LIMITS, item_limits={"image": 3})


@pytest.mark.parametrize(
    ("url", "status", "words"),
    [
        (_png(2000, 1000), HTTPStatus.BAD_REQUEST, "pixels"),
        (_png(400, 1), HTTPStatus.BAD_REQUEST, "aspect ratio"),
        ("data:image/png;base64," + "A" * (2 << 20), HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "more than the limit"),
        ("data:image/png;base64,", HTTPStatus.BAD_REQUEST, "empty"),
        ("data:image/png;base64,****", HTTPStatus.BAD_REQUEST, "invalid base64"),
        ("data:image/png;base64,aGVsbG8", HTTPStatus.BAD_REQUEST, "Incorrect padding"),  # unpadded
        ("data:image/png;base64,aGVs\nbG8=", HTTPStatus.BAD_REQUEST, "Only base64 data"),  # line-wrapped
        ("data:image/png;base64,aGVsbG8é", HTTPStatus.BAD_REQUEST, "invalid base64"),  # not ASCII
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), HTTPStatus.BAD_REQUEST, "readable"),
        ("https://example.invalid/a.png", HTTPStatus.BAD_REQUEST, "remote"),
        ("file:///etc/passwd", HTTPStatus.BAD_REQUEST, "local file"),
        ("gopher://x", HTTPStatus.BAD_REQUEST, "unsupported"),
    ],
)
def test_refusals_name_the_part_and_the_problem(url: str, status: HTTPStatus, words: str) -> None:
    with pytest.raises(MediaError) as err:
        check_media(_chat({"type": "image_url", "image_url": {"url": url}}), LIMITS)
    assert err.value.status == status and words in str(err.value) and "messages[1].content[0]" in str(err.value)


def test_policies_can_be_opened() -> None:
    open_limits = MediaLimits(1 << 20, 1_000_000, 200, remote_media=True, local_media=True)
    body = _chat({"type": "image_url", "image_url": {"url": "https://a/b.png"}},
                 {"type": "image_url", "image_url": {"url": "file:///srv/media/a.png"}})  # fmt: skip
    assert check_media(body, open_limits).parts == 2


def test_remote_addresses_must_be_public_unless_named_literally() -> None:
    from server.api.remote_media import RemotePolicy, address_allowed

    policy = RemotePolicy(allowed_hosts=frozenset({"media.example.com", "10.0.0.5"}), timeout_s=5)
    assert address_allowed("media.example.com", "93.184.216.34", policy)
    assert not address_allowed("media.example.com", "10.0.0.7", policy)  # a name resolving inside
    assert not address_allowed("media.example.com", "127.0.0.1", policy)
    assert not address_allowed("media.example.com", "169.254.169.254", policy)  # cloud metadata
    assert address_allowed("10.0.0.5", "10.0.0.5", policy)  # the operator named this address


SERVER = PixelBounds(min_pixels=32 * 32, max_pixels=512 * 512)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (None, SERVER),
        ({}, SERVER),
        ({"max_pixels": 64 * 64}, PixelBounds(32 * 32, 64 * 64)),
        ({"size": {"longest_edge": 128 * 128, "shortest_edge": 64 * 64}}, PixelBounds(64 * 64, 128 * 128)),
        ({"max_pixels": 128 * 128, "min_pixels": 64 * 64}, PixelBounds(64 * 64, 128 * 128)),
        ({"min_pixels": 512 * 512}, PixelBounds(512 * 512, 512 * 512)),  # within the bound: allowed
    ],
)
def test_requests_may_lower_the_processed_size(kwargs: object, expected: PixelBounds) -> None:
    assert requested_pixel_bounds(kwargs, SERVER) == expected


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"min_pixels": 10**9}, "above this server's processed image bound of 262144"),
        ({"max_pixels": 513 * 512}, "above this server's processed image bound"),
        ({"size": {"shortest_edge": 10**8, "longest_edge": 10**8}}, "above this server's processed image bound"),
        ({"size": {"longest_edge": 4096}}, "needs both shortest_edge and longest_edge"),  # HF would raise later
        ({"size": {}}, "needs both"),
        ({"min_pixels": 128 * 128, "max_pixels": 64 * 64}, "above max_pixels"),
        ({"patch_size": 4}, "patch_size may not be set"),
        ({"size": {"height": 900, "width": 900}}, "size may not be set"),
        ({"images_kwargs": {"min_pixels": 10**9}}, "images_kwargs may not be set"),
        ({"max_pixels": "1000"}, "positive integer"),
        ({"max_pixels": True}, "positive integer"),
        ({"max_pixels": -5}, "positive integer"),
        ("max_pixels=5", "must be an object"),
    ],
)
def test_requests_may_not_raise_it_or_change_the_grid(kwargs: object, words: str) -> None:
    body = {"mm_processor_kwargs": kwargs, **_chat({"type": "image_url", "image_url": {"url": _png(64, 64)}})}
    with pytest.raises(MediaError) as err:
        check_media(body, LIMITS, SERVER)
    assert err.value.status == HTTPStatus.BAD_REQUEST and words in str(err.value)


def test_server_bounds_come_from_the_processor_config_then_the_operator() -> None:
    qwen3 = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}
    assert server_pixel_bounds(qwen3, None) == PixelBounds(65536, 16777216)
    assert server_pixel_bounds(qwen3, {"max_pixels": 1 << 20}) == PixelBounds(65536, 1 << 20)
    qwen2 = {"min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1, "longest_edge": 2}}
    assert server_pixel_bounds(qwen2, {}) == PixelBounds(3136, 12845056)  # the processor's own precedence
    assert server_pixel_bounds({"crop_size": 336}, None) is None  # not a pixel-bounded processor


def _noisy_png(w: int, h: int, mode: str = "RGB", text: int = 0) -> bytes:
    """A PNG of random pixels (it does not compress: its data runs past the door's header read), with a
    ``text``-byte tEXt chunk before its pixel data."""
    import os

    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    if text:
        info.add_text("note", "n" * text)
    buf = io.BytesIO()
    Image.frombytes(mode, (w, h), os.urandom(w * h * len(mode))).save(buf, "PNG", pnginfo=info)
    return buf.getvalue()


@pytest.mark.parametrize("text", [0, 200_000])  # the header inside the door's first read, and past it
def test_a_large_images_header_is_read_wherever_it_ends(text: int) -> None:
    """The door reads an image's header from the start of its data (a decoded prefix) when it is there,
    else from the whole: the same verdicts either way, and the whole data for an image to normalise."""
    limits = dataclasses.replace(LIMITS, max_image_bytes=4 << 20, normalize=True)
    plain, alpha = _noisy_png(300, 200, text=text), _noisy_png(300, 200, "LA", text=text)
    assert len(base64.b64encode(plain)) > 65536
    as_uri = "data:image/png;base64,{}".format
    assert check_media(_chat({"type": "image_url", "image_url": {"url": as_uri(base64.b64encode(plain).decode())}}),
                       limits) == (1, ())  # fmt: skip
    [pending] = check_media(
        _chat({"type": "image_url", "image_url": {"url": as_uri(base64.b64encode(alpha).decode())}}), limits
    ).pending
    assert (pending.pixels, pending.data) == (60_000, alpha)
    big = _noisy_png(1200, 1000, text=text)  # 1.2 MP, above the 1 MP limit
    with pytest.raises(MediaError, match="pixels"):
        check_media(_chat({"type": "image_url", "image_url": {"url": as_uri(base64.b64encode(big).decode())}}), limits)
