"""The decoded-image cache (:mod:`server.api.image_cache`) over vLLM's own image media IO: a hit is the
same pixels as a decode, its own copy; settings and bytes both key it; it holds its byte bound."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
from PIL import Image

from server.api.image_cache import DecodedImageCache, settings_of
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


def _loaded(cache: DecodedImageCache, media_io: Any, data: bytes) -> Any:
    """What the connector does: a hit, else vLLM's decode, kept."""
    key = cache.key(media_io, data)
    assert key is not None
    if (hit := cache.get(key)) is not None:
        return hit
    loaded = media_io.load_bytes(data)
    cache.put(key, loaded)
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
    assert cache.key(white, data) != cache.key(black, data)
    assert _pixels(_loaded(cache, black, data)) == _pixels(_io(rgba_background_color=[0, 0, 0]).load_bytes(data))
    assert cache.key(white, data) != cache.key(white, KINDS["rgb-png"])


def test_an_io_holding_anything_but_plain_settings_is_not_cached() -> None:
    media_io = _io()
    assert settings_of(media_io) is not None
    media_io.budget = threading.Lock()  # e.g. a per-request object a later vLLM hands its IOs
    assert settings_of(media_io) is None and DecodedImageCache(1 << 20).key(media_io, b"x") is None
    assert DecodedImageCache(0).key(_io(), b"x") is None  # off


def test_it_holds_its_byte_bound_least_recently_used_first_out() -> None:
    size = 64 * 48 * 3  # each image's decoded bytes
    cache, media_io = DecodedImageCache(2 * size), _io()
    images = [_encoded("RGB", (64, 48), "PNG", seed) for seed in range(3)]
    keys = [cache.key(media_io, data) for data in images]
    for data in images[:2]:
        _loaded(cache, media_io, data)
    assert cache.get(keys[0]) is not None  # now the most recently used
    _loaded(cache, media_io, images[2])  # evicts images[1]
    assert len(cache) == 2 and m.IMAGE_CACHE_BYTES._value.get() == 2 * size
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and cache.get(keys[2]) is not None
    small = DecodedImageCache(size - 1)  # an image larger than the whole cache is not kept
    _loaded(small, media_io, images[0])
    assert len(small) == 0


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
