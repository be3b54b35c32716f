"""``vlguard bench normalize``: what image normalisation costs per image (milliseconds).

The media policy's work on one image (where vLLM loads it), with normalisation off (header checks only,
stock pixels) and on, side by side in one run: for images no rule applies to (an RGB JPEG, an RGBA PNG)
and for each rule (an EXIF Orientation=6 phone JPEG, a palette PNG with a transparent colour, a 16-bit
greyscale PNG). The images are the bundled photo scaled to ``--size``; each is timed ``--repeat`` times,
medians printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
import time

import numpy as np
from PIL import Image

from server.api.media import MediaLimits, checked_image
from server.workload.images import photo_bytes

LIMITS = MediaLimits(
    max_image_bytes=64 << 20, max_image_pixels=50_000_000, max_aspect_ratio=200, remote_media=False, local_media=False
)


def _encoded(img: Image.Image, fmt: str, **params: object) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **params)
    return out.getvalue()


def images(width: int, height: int) -> dict[str, bytes]:
    """The benchmark's images: name -> encoded bytes (``photo`` scaled to ``width x height``)."""
    photo = Image.open(io.BytesIO(photo_bytes("astronaut.png"))).convert("RGB").resize((width, height))
    exif = Image.Exif()
    exif[0x0112] = 6
    grey8 = np.asarray(photo.convert("L")).astype(np.uint16) * 257
    return {
        "RGB JPEG (no rule)": _encoded(photo, "JPEG", quality=90),
        "RGBA PNG (no rule)": _encoded(photo.convert("RGBA"), "PNG"),
        "EXIF-6 JPEG": _encoded(photo.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=90, exif=exif),
        "palette+tRNS PNG": _encoded(photo.convert("P"), "PNG", transparency=0),
        "16-bit grey PNG": _encoded(Image.frombytes("I;16", (width, height), grey8.astype("<u2").tobytes()), "PNG"),
    }


def _median_ms(data: bytes, limits: MediaLimits, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        checked_image("bench", data, limits)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vlguard bench normalize", description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1024x768", help="image size WIDTHxHEIGHT (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=20, help="timings per image and side (default 20)")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    on = dataclasses.replace(LIMITS, normalize=True)
    print(f"normalisation work per image, {width}x{height}, median of {args.repeat} (ms)")
    print(f"{'image':<22} {'KiB':>6} {'off':>8} {'on':>8} {'on/off':>7}")
    for name, data in images(width, height).items():
        off_ms, on_ms = _median_ms(data, LIMITS, args.repeat), _median_ms(data, on, args.repeat)
        print(f"{name:<22} {len(data) >> 10:>6} {off_ms:>8.2f} {on_ms:>8.2f} {on_ms / off_ms:>7.2f}")
    return 0
