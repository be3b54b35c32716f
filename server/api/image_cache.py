"""Decoded images, kept by the hash of their bytes: an image sent again is not decoded again.

The users' pipeline sends every image twice (a primary prompt, then a rescue prompt on the same image), and
vLLM's front end decodes it each time: PNG decoding is 1.7-6.5 ms of API-process CPU for the workload's
224-448 px images (docs/input.md). vLLM's own processor cache then skips the HF processor for the second
pass, but not the decode that comes before it.

Where vLLM loads an image (:mod:`server.vllm_hooks.media_connector`, after the media policy checked its
bytes) the decoded picture is kept here under the SHA-256 of its encoded bytes and the media IO's settings;
the next load of the same bytes with the same settings gets a copy of it instead of a decode.

* **Exact**: the same bytes under the same settings decode to the same pixels. Each load is handed its own
  copy (pixels, palette, ``info`` and the wrapper's settings: vLLM's code may change what it gets), with the
  decoder's ``format``; the copy is a plain ``PIL.Image.Image`` where vLLM 0.20-0.22 hand on the decoder's
  file object (``PngImageFile``). Multi-frame images (APNG, GIF) are not kept. A media IO holding
  anything but plain settings (per-request state) is never served from the cache.
* **Bounded**: every entry is charged what it holds (pixels at Pillow's bytes a pixel, the encoded bytes
  vLLM keeps beside them, the ``info`` values, and :data:`ENTRY_OVERHEAD`), at most ``max_bytes`` in all,
  least recently used first out; an image whose entry would exceed ``max_bytes / 16`` (known from its
  header before anything is hashed or copied) is not kept. A client sending many images evicts others'
  only to the cost stock pays for every image (a decode); a key is a cryptographic hash, so no one can
  name another's image.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import threading
from collections.abc import Hashable
from typing import Any

from server.metrics import definitions as m

#: Settings a media IO may hold and still be cached (values of these plain types only).
_PLAIN = (str, int, float, bool, type(None))
#: Bytes charged to every entry beyond its pixels, encoded bytes and ``info`` (its Python and Pillow objects).
ENTRY_OVERHEAD = 4096
#: An entry may take at most this share of the cache.
ENTRY_SHARE = 16


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


def pixel_bytes(width: int, height: int, mode: str) -> int:
    """Bytes Pillow holds for a ``width x height`` image of ``mode``: one a pixel for the 8-bit single-band
    modes, four for every other (RGB is stored as four)."""
    return width * height * (1 if mode in ("1", "L", "P") else 4)


def _image_of(loaded: Any) -> Any:
    """The PIL image in what a media IO loaded (an image, or vLLM's ``MediaWithBytes`` around one), else None."""
    from PIL import Image

    if isinstance(loaded, Image.Image):
        return loaded
    media = getattr(loaded, "media", None) if dataclasses.is_dataclass(loaded) else None
    return media if isinstance(media, Image.Image) else None


def _copy_image(image: Any) -> Any:
    new = image.copy()
    new.info = copy.deepcopy(image.info)
    new.format, new.format_description = image.format, getattr(image, "format_description", None)
    return new


def _copy(loaded: Any) -> Any:
    """A copy of what a media IO loaded: its image copied (pixels, palette, ``info``, format) and the
    wrapper's dict fields (settings) copied; its encoded bytes shared (immutable)."""
    image = _image_of(loaded)
    if loaded is image:
        return _copy_image(image)
    changes = {f.name: copy.deepcopy(getattr(loaded, f.name)) for f in dataclasses.fields(loaded)
               if isinstance(getattr(loaded, f.name), dict)}  # fmt: skip
    return dataclasses.replace(loaded, media=_copy_image(image), **changes)


def _charge(image: Any, data: bytes) -> int:
    """Bytes an entry for ``image`` (decoded from ``data``) holds."""
    info = sum(len(v) for v in image.info.values() if isinstance(v, (str, bytes, bytearray)))
    return pixel_bytes(image.width, image.height, image.mode) + len(data) + info + ENTRY_OVERHEAD


class DecodedImageCache:
    """Decoded images by their bytes' SHA-256 and their media IO's settings, least recently used first out.

    Arguments:
        max_bytes: bytes its entries may hold in all (:func:`_charge`); 0: off, every image is decoded.

    Thread-safe: vLLM loads images on several threads at once.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(max_bytes, 0)
        self.max_entry = self.max_bytes // ENTRY_SHARE
        self._kept: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def key(self, media_io: Any, data: bytes, pixels: int) -> Hashable | None:
        """The key of ``data`` (an image of ``pixels`` pixels, from its header) loaded by ``media_io``; None
        when it is not cached (cache off, an entry too large, or an IO holding per-request state)."""
        cost = pixel_bytes(pixels, 1, "RGB") + len(data) + ENTRY_OVERHEAD
        if cost > self.max_entry or (settings := settings_of(media_io)) is None:
            m.IMAGE_CACHE_LOADS.labels(result="skipped").inc()
            return None
        return settings, hashlib.sha256(data).digest()

    def get(self, key: Hashable) -> Any | None:
        """A copy of what was loaded under ``key``, or None (a miss)."""
        with self._lock:
            entry = self._kept.get(key)
            if entry is not None:
                self._kept.move_to_end(key)
        m.IMAGE_CACHE_LOADS.labels(result="miss" if entry is None else "hit").inc()
        return None if entry is None else _copy(entry[0])

    def put(self, key: Hashable, loaded: Any, data: bytes) -> None:
        """Keep a copy of ``loaded`` (what the media IO returned for ``data``) under ``key``; not kept when
        it is no single-frame image or its entry would exceed ``max_bytes / 16``. Evicts the least recently
        used entries to make room."""
        image = _image_of(loaded)
        if image is None or getattr(image, "n_frames", 1) != 1 or (size := _charge(image, data)) > self.max_entry:
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
