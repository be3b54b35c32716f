"""The media policy vLLM's media layer applies (:mod:`server.api.media_policy`): schemes, hosts, bytes and
pixels from headers, frames, per-request ``media_io_kwargs``."""

from __future__ import annotations

import argparse
import base64
import io
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from server.api.media import MediaError
from server.api.media_policy import MediaPolicy
from server.settings import GuardSettings
from tests.helpers import png


def policy(**settings: Any) -> MediaPolicy:
    args = argparse.Namespace(allowed_media_domains=["media.example"], media_io_kwargs={"video": {"num_frames": 64}})
    return MediaPolicy.of(GuardSettings(**settings), args)


def mp4(width: int, height: int, frames: int) -> bytes:
    import cv2

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "v.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 10, (width, height))
        for _ in range(frames):
            writer.write(np.zeros((height, width, 3), np.uint8))
        writer.release()
        return Path(path).read_bytes()


@pytest.mark.parametrize(
    ("modality", "url", "words"),
    [
        ("image", "http://127.0.0.1/x.png", "remote media"),
        ("image", "HTTPS://media.example/x.png", "remote media"),
        ("image", "file:///etc/passwd", "allowed-local-media-path"),
        ("image", "ftp://h/x", "'ftp'"),
        ("image", "no-scheme", "(none)"),
        ("video", "gopher://h/", "'gopher'"),
        ("image", " data:image/png;base64,AAAA", "whitespace"),
        ("image", "data:image/png;base64,AAAA\n", "whitespace"),
        ("image", "data:image/png;base64", "data:<type>;base64"),  # no comma, no data
        ("image", "DATA:image/png;BASE64,AAAA#", "base64 only"),
        ("image", "data:image/png#x;base64,AAAA", "base64 only"),  # vLLM's parser: "not enough values to unpack"
        ("image", "data:image/png,AAAA", "data:<type>;base64"),
        ("image", "data:image/png;base64,AAAA#!!!not-base64!!!", "base64 only"),  # vLLM's parser drops a fragment
        ("image", "data:image/png;base64,AAAA?x=%%%", "base64 only"),  # and a query
    ],
)
def test_schemes_are_refused_before_any_connection(modality: str, url: str, words: str) -> None:
    with pytest.raises(MediaError, match=words.replace("(", r"\(").replace(")", r"\)")):
        policy().check_url(modality, url)
    assert policy().check_url("image", "data:image/png;base64,AAAA") == "data"


def test_remote_images_only_with_remote_media_on_and_only_from_allowed_public_hosts() -> None:
    on = policy(remote_media=True)
    assert on.check_url("image", "https://media.example/x.png") == "https"
    with pytest.raises(MediaError, match="only images"):
        on.check_url("video", "https://media.example/v.mp4")
    # the fetch itself (hosts, addresses, redirects, size): tests/api/test_remote_media.py


@pytest.mark.parametrize(
    ("kwargs", "ok"),
    [
        ({"video": {"num_frames": 8}}, True),
        ({"video": {"num_frames": 64}}, True),  # the operator's own value
        ({"video": {"fps": 2}}, True),
        ({"video": {"num_frames": -1}}, False),
        ({"video": {"num_frames": 33}}, False),
        ({"video": {"num_frames": True}}, False),
        ({"video": {"fps": float("inf")}}, False),
        ({"video": {"fps": 0}}, False),
        ({"video": {"video_backend": "opencv_dynamic"}}, False),
        ({"image": {"image_mode": "I;16"}}, False),
        ({"audio": {"anything": 1}}, False),
        (None, True),
    ],
)
def test_per_request_media_io_kwargs(kwargs: Any, ok: bool) -> None:
    if ok:
        policy().check_io_kwargs(kwargs)
    else:
        with pytest.raises(MediaError, match="media_io_kwargs"):
            policy().check_io_kwargs(kwargs)


def test_images_are_checked_from_their_header_and_bytes() -> None:
    p = policy(max_image_pixels=10_000, max_image_mb=0.01)
    p.image_bytes("image", png(100, 100))
    with pytest.raises(MediaError, match="10100 pixels"):
        p.image_bytes("image", png(101, 100))
    with pytest.raises(MediaError, match="more than the limit of 10485"):
        p.image_bytes("image", b"\0" * 20_000)
    with pytest.raises(MediaError, match="more than 10485 bytes"):
        p.base64_payload("image", "A" * 20_000)
    with pytest.raises(MediaError, match="invalid base64"):
        p.base64_payload("image", "!!!!")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (_b64(png(2000, 1000)), "pixels"),
        (_b64(png(400, 1)), "aspect ratio"),
        ("****", "invalid base64"),
        ("aGVsbG8", "Incorrect padding"),  # unpadded
        ("aGVs\nbG8=", "Only base64 data"),  # line-wrapped
        ("aGVsbG8é", "invalid base64"),  # not ASCII
        (_b64(b"not an image"), "not a readable image"),
    ],
)
def test_an_image_refused_where_vllm_loads_it_names_the_problem(payload: str, words: str) -> None:
    """What the door no longer reads (tests/unit/test_media.py): refused in the media layer, as a 400."""
    p = policy(max_image_pixels=1_000_000)
    with pytest.raises(MediaError) as err:
        p.image_bytes("image", p.base64_payload("image", payload), rules=True)
    assert err.value.status == 400 and str(err.value).startswith("image: ") and words in str(err.value)


async def test_an_image_a_rule_applies_to_is_normalised_in_the_decode_pool_and_others_pass_unchanged() -> None:
    """16-bit grey (a rule no vLLM lane applies itself): its header names the rule, and it is scaled to an
    8-bit PNG in the decode pool, its pixels taken from the pool's budget; an RGB image, a video frame
    (rules not asked for), or normalisation off: no rule, loaded as sent."""
    deep, rgb = png(8, 6, "I;16"), png(8, 6)
    p = policy()
    header = p.image_bytes("image", deep, rules=True)
    assert (header.rules, header.pixels) == (["bit-depth"], 48)
    taken: list[int] = []
    run = p.decoder.run

    async def spied(pixels: int, fn: Any, *args: object, **kwargs: Any) -> Any:
        taken.append(pixels)
        return await run(pixels, fn, *args, **kwargs)

    p.decoder.run = spied  # type: ignore[method-assign]
    out = await p.normalized_async("image", deep, header.pixels)
    assert Image.open(io.BytesIO(out)).mode == "L" and taken == [48]
    assert p.normalized("image", deep) == out  # vLLM's synchronous path: the same, on the calling thread
    assert p.image_bytes("image", rgb, rules=True).rules == []
    assert p.image_bytes("video frame", deep).rules == []
    assert policy(image_normalize=False).image_bytes("image", deep, rules=True).rules == []


def test_a_container_video_is_checked_from_its_header() -> None:
    """Frame size, frame count, and (#61) the frames' pixels together: at most twice an image's."""
    p = policy(max_image_pixels=64 * 48 * 2, max_video_frames=4)
    p.video_container("video", mp4(64, 48, 3), num_frames=32)
    p.video_container("video", mp4(64, 48, 10), num_frames=4)  # vLLM samples 4 of the 10
    with pytest.raises(MediaError, match="its frames hold 24576 pixels together, more than the limit of 12288"):
        p.video_container("video", mp4(96, 64, 4), num_frames=4)
    with pytest.raises(MediaError, match="10 frames, more than the limit of 4"):
        p.video_container("video", mp4(64, 48, 10), num_frames=-1)
    with pytest.raises(MediaError, match="frames of 100x64"):
        p.video_container("video", mp4(100, 64, 2), num_frames=32)
    with pytest.raises(MediaError, match="not a readable video"):
        p.video_container("video", b"not a video at all", num_frames=32)
