"""The decoded-image cache (:mod:`server.api.image_cache`) over vLLM's own image media IO: a hit is the
same pixels as a decode, its own copy; settings and bytes both key it; it holds its byte bound."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
from PIL import Image

from server.api.image_cache import ENTRY_OVERHEAD, DecodedImageCache, pixel_bytes, settings_of
from server.metrics import definitions as m


def _encoded(mode: str, size: tuple[int, int], fmt: str, seed: int = 0) -> bytes:
    """An image of varied pixels (not a flat colour: decoders take different paths for those)."""
    image = (
        Image.effect_noise(size, 40 + seed).convert(mode)
        if mode != "RGB"
        else Image.merge("RGB", [Image.effect_noise(size, 30 + seed + band) for band in range(3)])
    )
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


KINDS = {
    "rgb-png": _encoded("RGB", (64, 48), "PNG"),
    "rgba-png": _encoded("RGBA", (40, 40), "PNG"),
    "palette-png": _encoded("P", (33, 17), "PNG"),
    "grey-jpeg": _encoded("L", (50, 30), "JPEG"),
    "rgb-jpeg": _encoded("RGB", (64, 64), "JPEG"),
}


def _io(**kwargs: Any) -> Any:
    from vllm.multimodal.media import ImageMediaIO

    return ImageMediaIO(**kwargs)


def _header_pixels(data: bytes) -> int:
    with Image.open(io.BytesIO(data)) as image:
        return image.width * image.height


def _loaded(cache: DecodedImageCache, media_io: Any, data: bytes) -> Any:
    """What the connector does: a hit, else vLLM's decode, kept."""
    key = cache.key(media_io, data, _header_pixels(data))
    assert key is not None
    if (hit := cache.get(key)) is not None:
        return hit
    loaded = media_io.load_bytes(data)
    cache.put(key, loaded, data)
    return loaded


def _pixels(loaded: Any) -> tuple[str, tuple[int, int], bytes]:
    image = getattr(loaded, "media", loaded)
    return image.mode, image.size, image.tobytes()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_hit_is_the_decode_of_the_same_bytes_in_a_copy_of_its_own(kind: str) -> None:
    data, cache, media_io = KINDS[kind], DecodedImageCache(1 << 20), _io()
    hits = m.IMAGE_CACHE_LOADS.labels(result="hit")._value.get()
    first = _loaded(cache, media_io, data)
    second = _loaded(cache, media_io, data)
    assert m.IMAGE_CACHE_LOADS.labels(result="hit")._value.get() == hits + 1
    decoded = _io().load_bytes(data)
    assert _pixels(second) == _pixels(first) == _pixels(decoded)
    assert type(second) is type(decoded) and getattr(second, "original_bytes", data) == data
    hit, fresh = getattr(second, "media", second), getattr(decoded, "media", decoded)
    assert (hit.format, hit.info, hit.getpalette()) == (fresh.format, fresh.info, fresh.getpalette())
    # Each load owns its pixels: changing one changes neither the next hit nor the first load.
    image = getattr(second, "media", second)
    assert image is not getattr(first, "media", first)
    image.paste(0, (0, 0, *image.size))
    assert _pixels(_loaded(cache, media_io, data)) == _pixels(decoded) == _pixels(first)


def test_the_settings_and_the_bytes_key_it() -> None:
    cache, data = DecodedImageCache(1 << 20), KINDS["rgba-png"]
    rgb, rgba = _loaded(cache, _io(), data), _loaded(cache, _io(image_mode="RGBA"), data)
    assert _pixels(rgb)[0] == "RGB" and _pixels(rgba)[0] == "RGBA" and len(cache) == 2
    white, black = _io(), _io(rgba_background_color=[0, 0, 0])
    assert cache.key(white, data, 1) != cache.key(black, data, 1)
    assert _pixels(_loaded(cache, black, data)) == _pixels(_io(rgba_background_color=[0, 0, 0]).load_bytes(data))
    assert cache.key(white, data, 1) != cache.key(white, KINDS["rgb-png"], 1)


def test_an_io_holding_anything_but_plain_settings_is_not_cached() -> None:
    media_io = _io()
    assert settings_of(media_io) is not None
    media_io.budget = threading.Lock()  # e.g. a per-request object a later vLLM hands its IOs
    assert settings_of(media_io) is None and DecodedImageCache(1 << 20).key(media_io, b"x", 1) is None
    assert DecodedImageCache(0).key(_io(), b"x", 1) is None  # off


def test_where_vllm_charges_a_per_request_decode_budget_the_cache_is_off() -> None:
    """vLLM 0.34 charges each request's decoded bytes to the request's own budget, which a hit would skip:
    the policy's cache is off there, on every route (a budget-less IO would pass the settings check)."""
    from server.api.media_policy import MediaPolicy
    from server.settings import GuardSettings
    from server.vllm_hooks.locations import upstream_decode_budget

    policy = MediaPolicy.of(GuardSettings(image_cache_mb=64), None)
    assert policy.image_cache.max_bytes == (0 if upstream_decode_budget() else 64 << 20)


def test_it_holds_its_byte_bound_least_recently_used_first_out() -> None:
    images = [_encoded("RGB", (64, 48), "PNG", seed) for seed in range(3)]
    sizes = [pixel_bytes(64, 48, "RGB") + len(data) + ENTRY_OVERHEAD for data in images]
    cache, media_io = DecodedImageCache(16 * max(sizes)), _io()
    cache.max_bytes = sizes[0] + sizes[1] + min(sizes) // 2  # room for two entries, not three
    keys = [cache.key(media_io, data, 64 * 48) for data in images]
    for data in images[:2]:
        _loaded(cache, media_io, data)
    assert cache.get(keys[0]) is not None  # now the most recently used
    _loaded(cache, media_io, images[2])  # evicts images[1]
    assert len(cache) == 2 and m.IMAGE_CACHE_BYTES._value.get() == sizes[0] + sizes[2]
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and cache.get(keys[2]) is not None


def test_an_entry_is_charged_what_it_holds_and_a_large_one_is_not_kept() -> None:
    """A 1x1 PNG carrying 4 MiB of text chunks (a hostile client's 1000x amplification, charged by its pixels
    alone) is charged its text; past a sixteenth of the cache, not kept; a large image is refused from its
    header's pixel count before anything is hashed."""
    from PIL import PngImagePlugin

    meta = PngImagePlugin.PngInfo()
    for i in range(4):
        meta.add_text(f"note{i}", "x" * (1 << 20), zip=True)
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG", pnginfo=meta)
    texty = buf.getvalue()
    assert len(texty) < 64 << 10
    cache, media_io = DecodedImageCache(32 << 20), _io()
    _loaded(cache, media_io, texty)
    assert len(cache) == 0  # 4 MiB of text > 32 MiB / 16
    roomy = DecodedImageCache(128 << 20)
    _loaded(roomy, media_io, texty)
    assert len(roomy) == 1 and m.IMAGE_CACHE_BYTES._value.get() >= 4 << 20
    assert cache.key(media_io, b"x", (32 << 20) // 16 // 4) is None  # its pixels alone fill the entry bound


def test_a_multi_frame_image_is_not_kept_where_vllm_hands_on_every_frame() -> None:
    """vLLM 0.20-0.22 hand on the decoder's object, every frame of an APNG reachable (a copy would hold the
    first only): not kept. vLLM 0.32 on hand on the first frame alone (a plain image): kept, a hit as it."""
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, "PNG", save_all=True, append_images=frames[1:])
    data, cache = buf.getvalue(), DecodedImageCache(1 << 20)
    decoded = _io().load_bytes(data)
    every_frame = getattr(getattr(decoded, "media", decoded), "n_frames", 1) > 1
    first = _loaded(cache, _io(), data)
    assert len(cache) == (0 if every_frame else 1)
    assert _pixels(_loaded(cache, _io(), data)) == _pixels(decoded) == _pixels(first)


def test_loads_on_many_threads_agree() -> None:
    cache, media_io = DecodedImageCache(1 << 20), _io()
    images = [_encoded("RGB", (32, 32), "PNG", seed) for seed in range(4)]
    expected = [_pixels(_io().load_bytes(data)) for data in images]
    wrong: list[int] = []

    def load(i: int) -> None:
        for _ in range(25):
            if _pixels(_loaded(cache, media_io, images[i % 4])) != expected[i % 4]:
                wrong.append(i)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and len(cache) == 4
