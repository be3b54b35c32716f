"""Decoded images, kept by the hash of their bytes: an image sent again is not decoded again.

The users' pipeline sends every image twice (a primary prompt, then a rescue prompt on the same image), and
vLLM's front end decodes it each time: PNG decoding is 1.7-6.5 ms of API-process CPU for the workload's
224-448 px images, against ~13 ms for the whole request (docs/benchmarks.md). vLLM's own processor cache
then skips the HF processor for the second pass, but not the decode that comes before it.

Where vLLM loads an image (:mod:`server.vllm_hooks.media_connector`, after the media policy checked its
bytes) the decoded picture is kept here under the SHA-256 of its encoded bytes and the media IO's settings;
the next load of the same bytes with the same settings gets a copy of it instead of a decode.

* **Exact**: the same bytes under the same settings decode to the same pixels; each load is handed its own
  copy (vLLM's code may change the image it gets), and a media IO holding anything but plain settings
  (a per-request object, such as a later vLLM's decoded-pixel budget) is never served from the cache.
* **Bounded**: at most ``max_bytes`` of decoded pixels (width x height x bands), least recently used first
  out; a larger image is not kept. A client sending many images evicts others' only to the cost stock pays
  for every image (a decode); a key is a cryptographic hash, so no one can name another's image.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from collections.abc import Hashable
from typing import Any

from server.metrics import definitions as m

#: Settings a media IO may hold and still be cached (values of these plain types only).
_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any) -> Hashable | None:
    """``value`` as a hashable of plain values (tuples for lists and dicts), or None when it holds anything else."""
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return None if any(i is None for i in items) else tuple(items)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        pairs = [(k, _plain(v)) for k, v in sorted(value.items())]
        return None if any(v is None for _, v in pairs) else tuple(pairs)
    return None


def settings_of(media_io: Any) -> Hashable | None:
    """The settings a media IO decodes with (its class and attributes), or None when one of them is not a
    plain value (the IO then holds per-request state, and its loads are not cached)."""
    attrs = _plain(dict(vars(media_io)))
    return None if attrs is None else (type(media_io).__module__, type(media_io).__qualname__, attrs)


def _image_of(loaded: Any) -> Any:
    """The PIL image in what a media IO loaded (an image, or vLLM's ``MediaWithBytes`` around one), else None."""
    from PIL import Image

    if isinstance(loaded, Image.Image):
        return loaded
    media = getattr(loaded, "media", None) if dataclasses.is_dataclass(loaded) else None
    return media if isinstance(media, Image.Image) else None


def _copy(loaded: Any) -> Any:
    """A copy of what a media IO loaded, its image's pixels copied (the rest shared: bytes, settings)."""
    image = _image_of(loaded)
    return image.copy() if loaded is image else dataclasses.replace(loaded, media=image.copy())


class DecodedImageCache:
    """Arguments:
    max_bytes: decoded bytes kept at most (0: nothing is kept, every image is decoded).

    Thread-safe: vLLM loads images on several threads at once.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(max_bytes, 0)
        self._kept: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        m.IMAGE_CACHE_BYTES.set(0)

    def key(self, media_io: Any, data: bytes) -> Hashable | None:
        """The key of ``data`` loaded by ``media_io`` (None: not cacheable, or the cache is off)."""
        if not self.max_bytes or (settings := settings_of(media_io)) is None:
            return None
        return settings, hashlib.sha256(data).digest()

    def get(self, key: Hashable) -> Any | None:
        """A copy of the image kept under ``key`` (None when there is none: a miss)."""
        with self._lock:
            entry = self._kept.get(key)
            if entry is not None:
                self._kept.move_to_end(key)
        if entry is None:
            m.IMAGE_CACHE_LOADS.labels(result="miss").inc()
            return None
        m.IMAGE_CACHE_LOADS.labels(result="hit").inc()
        return _copy(entry[0])

    def put(self, key: Hashable, loaded: Any) -> None:
        """Keep a copy of ``loaded`` (what the media IO returned) under ``key``; not an image, or larger
        than the whole cache: not kept. Evicts the least recently used images to make room."""
        image = _image_of(loaded)
        if image is None:
            return
        size = image.width * image.height * len(image.getbands())
        if size > self.max_bytes:
            return
        kept = _copy(loaded)
        with self._lock:
            if key in self._kept:
                return
            while self._bytes + size > self.max_bytes:
                self._bytes -= self._kept.popitem(last=False)[1][1]
            self._kept[key] = (kept, size)
            self._bytes += size
            m.IMAGE_CACHE_BYTES.set(self._bytes)

    def __len__(self) -> int:
        return len(self._kept)
