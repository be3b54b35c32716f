"""Image normalisation (server.api.pixels): each rule against the picture a viewer shows, and a table over
every mode each format can carry (no rule may fail, and an image no rule touches is passed on as sent)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from server.api.pixels import ORIENTATION_TAG, needs_normalizing, normalize_image

#: A picture with structure in both directions (so a rotation or a flip changes it).
_COLUMNS, _ROWS = np.meshgrid(np.arange(48) * 5, np.arange(32) * 7, indexing="xy")
UPRIGHT = Image.fromarray(np.stack([_COLUMNS, _ROWS, np.full((32, 48), 90)], -1).astype(np.uint8), "RGB")


def encode(img: Image.Image, fmt: str, **params: object) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **params)
    return out.getvalue()


def seen_by_engine(data: bytes) -> np.ndarray:
    """The pixels vLLM hands its processor for ``data`` after normalisation (its own RGB conversion)."""
    normalized = normalize_image(data)
    img = Image.open(io.BytesIO(normalized if normalized is not None else data))
    if img.mode == "RGBA":  # vLLM composites RGBA on white itself
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, img)
    return np.asarray(img.convert("RGB"), dtype=np.int16)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
@pytest.mark.parametrize("orientation", [3, 6, 8, 2])
def test_exif_orientation_is_applied(fmt: str, orientation: int) -> None:
    # What a phone does: it stores the sensor's pixels and says in EXIF how to turn them.
    stored = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270,
              2: Image.Transpose.FLIP_LEFT_RIGHT}[orientation]  # fmt: skip
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = orientation
    lossless = {"JPEG": {"quality": 100, "subsampling": 0}, "WEBP": {"lossless": True}}.get(fmt, {})
    data = encode(UPRIGHT.transpose(stored), fmt, exif=exif, **lossless)
    seen = seen_by_engine(data)
    assert seen.shape[:2] == (32, 48)  # upright, as every viewer shows it
    tolerance = 4 if fmt == "JPEG" else 0
    assert np.abs(seen - np.asarray(UPRIGHT, dtype=np.int16)).max() <= tolerance


def test_orientation_1_and_no_exif_pass_unchanged() -> None:
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = 1
    assert normalize_image(encode(UPRIGHT, "JPEG", exif=exif)) is None
    assert normalize_image(encode(UPRIGHT, "JPEG")) is None


def _half_transparent(mode: str) -> tuple[Image.Image, str]:
    """An image whose left half is fully transparent over a hidden red (or black) colour."""
    if mode == "P+tRNS":
        img = Image.new("P", (16, 8), 1)
        img.putpalette([0, 0, 0, 255, 0, 0, 0, 0, 255])
        img.paste(2, (8, 0, 16, 8))
        img.info["transparency"] = 1  # palette entry 1 (red) is transparent
        return img, "PNG"
    if mode in ("RGB+tRNS", "L+tRNS"):
        base = "RGB" if mode.startswith("RGB") else "L"
        hidden = (255, 0, 0) if base == "RGB" else 0
        img = Image.new(base, (16, 8), hidden)
        img.paste((0, 0, 255) if base == "RGB" else 128, (8, 0, 16, 8))
        img.info["transparency"] = hidden
        return img, "PNG"
    rgba = Image.new("RGBA", (16, 8), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (8, 0, 16, 8))
    if mode == "LA":
        return rgba.convert("LA"), "PNG"
    if mode == "PA":
        return rgba.convert("PA"), "TIFF"
    return rgba.convert(mode), "TIFF" if mode in ("RGBa", "La") else "PNG"


@pytest.mark.parametrize("mode", ["P+tRNS", "RGB+tRNS", "L+tRNS", "LA", "PA", "RGBA"])
def test_transparency_is_composited_on_white(mode: str) -> None:
    img, fmt = _half_transparent(mode)
    seen = seen_by_engine(encode(img, fmt, transparency=img.info["transparency"]) if "transparency" in img.info
                          else encode(img, fmt))  # fmt: skip
    assert (seen[:, :8] == 255).all(), f"{mode}: the hidden colour under the transparency reached the model"
    assert (seen[:, 8:] != 255).any()  # the opaque half is untouched


def wide_grey(mode: str, grey8: np.ndarray) -> Image.Image:
    """``grey8`` in a 16/32-bit mode, each value times 257 (Pillow's ``convert`` to ``I;16B`` clamps)."""
    values = grey8.astype(np.uint32) * 257
    dtype = {"I;16": "<u2", "I;16L": "<u2", "I;16N": "=u2", "I;16B": ">u2", "I": "=i4"}[mode]
    return Image.frombytes(mode, (grey8.shape[1], grey8.shape[0]), values.astype(dtype).tobytes())


@pytest.mark.parametrize(("mode", "fmt"), [("I;16", "PNG"), ("I;16", "TIFF"), ("I;16B", "TIFF"), ("I", "TIFF")])
def test_16_bit_is_scaled_not_clamped(mode: str, fmt: str) -> None:
    grey8 = np.asarray(UPRIGHT.convert("L"))
    wide = wide_grey(mode, grey8)
    seen = seen_by_engine(encode(wide, fmt))
    assert np.abs(seen[..., 0] - grey8).max() <= 1  # the 8-bit picture, not an almost white one


def test_float_images_are_scaled_from_their_range() -> None:
    grey8 = np.asarray(UPRIGHT.convert("L"))
    unit = Image.fromarray(grey8.astype(np.float32) / 255.0, "F")
    assert np.abs(seen_by_engine(encode(unit, "TIFF"))[..., 0] - grey8).max() <= 1
    wide = Image.fromarray(grey8.astype(np.float32) * 1000.0 - 7.0, "F")  # any range: min to max
    seen = seen_by_engine(encode(wide, "TIFF"))[..., 0]
    assert seen.min() == 0 and seen.max() == 255


MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "I",
         "I;16", "I;16B", "I;16L", "I;16N", "F"]  # fmt: skip


def _carried() -> list[tuple[str, str]]:
    cases = []
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "TIFF"):
        for mode in MODES:
            try:
                encode(Image.new(mode, (8, 8)), fmt)
            except (OSError, ValueError, KeyError):
                continue  # the format cannot carry this mode
            cases.append((fmt, mode))
    return cases


@pytest.mark.parametrize(("fmt", "mode"), _carried())
def test_every_mode_a_format_carries_reaches_the_engine_as_rgb(fmt: str, mode: str) -> None:
    grey8 = np.asarray(UPRIGHT.convert("L"))
    if mode.startswith("I"):
        img = wide_grey(mode, grey8)
    elif mode == "F":
        img = Image.fromarray(grey8.astype(np.float32) / 255.0, "F")
    else:
        img = UPRIGHT.convert(mode)
    data = encode(img, fmt)
    opened = Image.open(io.BytesIO(data))
    seen = seen_by_engine(data)  # never raises, always RGB
    assert seen.shape == (32, 48, 3)
    if not needs_normalizing(opened):
        assert normalize_image(data) is None  # passed on byte for byte
    if opened.mode.startswith(("I", "F")):
        assert np.abs(seen[..., 0] - grey8).max() <= 1, f"{fmt} {mode} -> {opened.mode}: not scaled"


@pytest.mark.parametrize(("mode", "fmt"), [("CMYK", "JPEG"), ("CMYK", "TIFF"), ("YCbCr", "TIFF"), ("LAB", "TIFF")])
def test_turned_images_of_modes_png_cannot_hold_are_converted_as_vllm_would(mode: str, fmt: str) -> None:
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = 6
    data = encode(UPRIGHT.transpose(Image.Transpose.ROTATE_90).convert(mode), fmt, exif=exif)
    seen = seen_by_engine(data)
    expected = np.asarray(UPRIGHT.convert(mode).convert("RGB"), dtype=np.int16)
    assert seen.shape == (32, 48, 3) and np.abs(seen - expected).max() <= (40 if fmt == "JPEG" else 2)


@pytest.mark.parametrize("value", [0, 9, 1])
def test_invalid_orientation_values_leave_the_image_alone(value: int) -> None:
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = value
    assert normalize_image(encode(UPRIGHT, "JPEG", exif=exif)) is None


def test_16_bit_transparent_grey_is_white() -> None:
    values = np.full((8, 16), 40000, dtype=np.uint16)
    values[:, :8] = 1000  # the tRNS grey level
    img = Image.frombytes("I;16", (16, 8), values.astype("<u2").tobytes())
    seen = seen_by_engine(encode(img, "PNG", transparency=1000))
    assert (seen[:, :8] == 255).all() and (seen[:, 8:] == round(40000 / 257)).all()


def test_float_images_with_inf_and_nan_scale_their_finite_range() -> None:
    values = np.tile(np.linspace(0, 4, 16, dtype=np.float32), (8, 1))
    values[0, 0], values[0, 1], values[0, 2] = np.inf, -np.inf, np.nan
    seen = seen_by_engine(encode(Image.fromarray(values, "F"), "TIFF"))[..., 0]
    assert seen[1, -1] == 255 and seen[1, 0] == 0 and seen[1, 8] == round(values[1, 8] / 4 * 255)
    assert seen[0, 0] == 255 and seen[0, 1] == 0


def test_rules_the_installed_vllm_applies_are_skipped() -> None:
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = 6
    turned = encode(UPRIGHT, "JPEG", exif=exif)
    assert normalize_image(turned) is not None
    assert normalize_image(turned, skip=frozenset({"orientation"})) is None  # vLLM 0.32 turns it itself
