"""Image normalisation: the engine sees the picture people see (``--guard-image-normalize``), applied
where vLLM loads an image (:class:`server.api.media_policy.MediaPolicy`), on every route.

vLLM converts every image with Pillow's ``convert("RGB")`` (compositing on white only for ``RGBA``). For
some images that is not what a viewer shows. Each rule below applies only when an image needs it; an
image no rule touches is passed on byte for byte (nothing decoded, nothing re-encoded):

1. **EXIF orientation** (tag 0x0112, values 2-8; EXIF 2.3 section 4.6.4): applied with Pillow's
   ``ImageOps.exif_transpose``, as every photo viewer does. Phones store pixels landscape and set 6 or 8.
2. **Transparency composited on white** (what vLLM already does for ``RGBA``): ``LA``, ``La``, ``PA``,
   ``RGBa``, and ``P``/``L``/``RGB``/``I`` images with a PNG ``tRNS`` transparency (Pillow exposes it as
   ``info["transparency"]``; PNG spec section 11.3.2.1). ``convert("RGB")`` drops the alpha and shows
   the colour hidden under it.
3. **High bit depth scaled, not clamped**: ``I;16*`` (16-bit PNG/TIFF, scans, X-rays) maps 0-65535 to
   0-255; ``I`` (32-bit integer) likewise when its values fit 16 bits, else its own min-max range;
   ``F`` (32-bit float) maps 0.0-1.0 to 0-255 when its values lie there, else its own min-max range.
   Pillow's ``convert`` clamps these to 255 (an almost white image).

Every other mode (``1``, ``L``, ``P``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV``, ``RGBX``) goes on unchanged:
Pillow's ``convert("RGB")``, which vLLM applies, converts them as the format specs define (the table test
in ``tests/unit/test_pixels.py`` checks each mode a PNG, JPEG, WebP, GIF or TIFF can carry). Known limit:
a CMYK image's embedded ICC profile is not applied (Pillow's conversion ignores it).

A normalised image is re-encoded as a PNG (lossless: the engine gets exactly these pixels; 8-bit RGB, or
``L`` for scaled greyscale, or its own mode when only the orientation changed).
Only the first frame of an animated image is used, as vLLM does.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

#: EXIF tag holding the orientation; 1 is "as stored".
ORIENTATION_TAG = 0x0112
#: Modes whose alpha ``convert("RGB")`` drops (``RGBA`` is composited by vLLM itself).
_ALPHA_MODES = {"RGBa", "LA", "La", "PA"}
_HIGH_DEPTH_PREFIXES = ("I;16", "I", "F")
#: Modes Pillow writes to PNG as they are.
_PNG_MODES = {"1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16"}


def needs_normalizing(img: Image.Image, skip: frozenset[str] = frozenset()) -> list[str]:
    """The rules that apply to an opened (not decoded) image: names from ``orientation``,
    ``transparency``, ``bit-depth``, less those in ``skip`` (rules the installed vLLM applies itself);
    empty when the image goes on unchanged."""
    rules = []
    # Pillow finds a PNG's eXIf chunk after the pixel data only by decoding them: only one before is read.
    has_exif = img.format != "PNG" or "exif" in img.info
    if has_exif and img.getexif().get(ORIENTATION_TAG, 1) in range(2, 9):  # 1 or an invalid value: as stored
        rules.append("orientation")
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rules.append("transparency")
    if img.mode.startswith(_HIGH_DEPTH_PREFIXES):
        rules.append("bit-depth")
    return [rule for rule in rules if rule not in skip]


def _scale_to_8bit(img: Image.Image) -> Image.Image:
    """A single-channel ``I;16*``/``I``/``F`` image as ``L``, scaled over its range (see rule 3)."""
    values = np.asarray(img, dtype=np.float32)
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if img.mode.startswith("I;16") or (img.mode == "I" and lo >= 0 and hi <= 65535):
        low, high = 0.0, 65535.0
    elif img.mode == "F" and lo >= 0 and hi <= 1:
        low, high = 0.0, 1.0
    else:
        low, high = lo, max(hi, lo + 1)
    scaled = np.rint((np.nan_to_num(values, nan=low, posinf=high, neginf=low) - low) * (255.0 / (high - low)))
    grey = np.clip(scaled, 0, 255).astype(np.uint8)
    transparent = img.info.get("transparency")
    if isinstance(transparent, int):  # a 16-bit tRNS grey level: those pixels are see-through -> white
        grey[values == transparent] = 255
    return Image.fromarray(grey, "L")


def _on_white(img: Image.Image) -> Image.Image:
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def normalize_image(data: bytes, skip: frozenset[str] = frozenset()) -> bytes | None:
    """Apply the module's rules to one encoded image.

    Arguments:
        data: an encoded image (any format Pillow reads) that already passed the media policy's checks.
        skip: rules not to apply (the installed vLLM applies them:
            ``server.vllm_hooks.locations.upstream_image_rules``).

    Returns:
        PNG bytes when a rule applied, else ``None`` (send ``data`` on unchanged).

    Raises:
        OSError, ValueError: Pillow could not decode the pixels (the caller answers 400).
    """
    with Image.open(io.BytesIO(data)) as opened:
        rules = needs_normalizing(opened, skip)
        if not rules:
            return None
        img: Image.Image = opened
        img.load()
        if "orientation" in rules:
            img = ImageOps.exif_transpose(img)
        if "bit-depth" in rules:
            img = _scale_to_8bit(img)
        elif "transparency" in rules:
            img = _on_white(img)
        if img.mode not in _PNG_MODES:  # e.g. a turned CMYK, YCbCr or LAB image: as vLLM would convert it
            img = img.convert("RGB")
        out = io.BytesIO()
        img.save(out, format="PNG", compress_level=1)
        return out.getvalue()
