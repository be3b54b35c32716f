"""The media checks on request bodies (pure)."""

from __future__ import annotations

import base64
import io
from http import HTTPStatus

import pytest
from PIL import Image

from server.api.media import MediaError, MediaLimits, check_media, media_parts

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
    assert [w for w, _, _ in media_parts(chat)] == ["messages[1].content[1]"]
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}
    assert list(media_parts(responses)) == [("input[0].content[0]", "input_image", "http://x/y.png")]
    audio = _chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    assert next(iter(media_parts(audio)))[2] == "data:audio/wav;base64,AAAA"


def test_a_good_image_passes_and_counts() -> None:
    assert check_media(_chat({"type": "image_url", "image_url": {"url": _png(64, 48)}}), LIMITS) == 1


@pytest.mark.parametrize(
    ("url", "status", "words"),
    [
        (_png(2000, 1000), HTTPStatus.BAD_REQUEST, "pixels"),
        (_png(400, 1), HTTPStatus.BAD_REQUEST, "aspect ratio"),
        ("data:image/png;base64," + "A" * (2 << 20), HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "more than the limit"),
        ("data:image/png;base64,", HTTPStatus.BAD_REQUEST, "empty"),
        ("data:image/png;base64,****", HTTPStatus.BAD_REQUEST, "invalid base64"),
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
    assert check_media(body, open_limits) == 2


def test_remote_addresses_must_be_public_unless_named_literally() -> None:
    from server.api.remote_media import RemotePolicy, address_allowed

    policy = RemotePolicy(allowed_hosts=frozenset({"media.example.com", "10.0.0.5"}), timeout_s=5)
    assert address_allowed("media.example.com", "93.184.216.34", policy)
    assert not address_allowed("media.example.com", "10.0.0.7", policy)  # a name resolving inside
    assert not address_allowed("media.example.com", "127.0.0.1", policy)
    assert not address_allowed("media.example.com", "169.254.169.254", policy)  # cloud metadata
    assert address_allowed("10.0.0.5", "10.0.0.5", policy)  # the operator named this address
