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
    image = _png(20, 10)
    odd = [{"type": ["image_url"]}, {"type": {"k": 1}}, {"type": None}, "text", 7]  # not media, no crash
    assert list(media_parts(_chat(*odd))) == []
    shapes = ({"image_url": image}, {"image_url": {"url": image}}, {"type": "text", "uuid": "u1", "image_url": image})
    for part in shapes:
        [found] = media_parts(_chat(part))  # vLLM reads these as images: so does the door
        assert (found.kind, found.url) == ("image_url", image)


def test_a_good_image_passes_and_counts() -> None:
    body = _chat({"type": "image_url", "image_url": {"url": _png(64, 48)}})
    assert check_media(body, LIMITS) == (1,)
    assert check_media(body, dataclasses.replace(LIMITS, normalize=True)) == (1,)


def test_the_door_reads_no_image_header_and_changes_nothing() -> None:
    """An image's header, base64 and pixels are checked (and the image normalised) where vLLM loads it
    (tests/unit/test_media_policy.py): the door checks the data URI's form and size only."""
    body = _chat({"type": "image_url", "image_url": {"url": _png(2000, 1000)}},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,****"}})  # fmt: skip
    before = repr(body)
    assert check_media(body, LIMITS) == (2,)
    assert repr(body) == before
    with pytest.raises(MediaError, match="pixels cannot be decoded"):
        normalized_image("x", b"not an image", LIMITS)  # what Pillow cannot decode: 400, not a 500


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
    with pytest.raises(MediaError, match="malformed data URI"):  # within the limit: checked as before
        check_media(body, LIMITS, item_limits={"image": 3})


@pytest.mark.parametrize(
    ("url", "status", "words"),
    [
        ("data:image/png;base64," + "A" * (2 << 20), HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "more than the limit"),
        ("data:image/png;base64,", HTTPStatus.BAD_REQUEST, "empty"),
        ("data:image/png,raw", HTTPStatus.BAD_REQUEST, "malformed data URI"),
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
