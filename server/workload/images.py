"""Real photographs without downloads: the ones scikit-image ships in its wheel.

Mixed formats, modes and sizes (RGB and grayscale PNG, RGBA PNG, JPEG), good real input for the demo,
tests and benchmarks.
"""

from __future__ import annotations

import base64
from pathlib import Path

#: name -> MIME type of the bundled files used here.
PHOTOS = {
    "astronaut.png": "image/png",  # RGB 512x512
    "coffee.png": "image/png",  # RGB 400x600
    "chelsea.png": "image/png",  # RGB 300x451
    "camera.png": "image/png",  # grayscale 512x512
    "logo.png": "image/png",  # RGBA 500x500
    "rocket.jpg": "image/jpeg",  # RGB JPEG 427x640
    "hubble_deep_field.jpg": "image/jpeg",  # RGB JPEG 872x1000
}


def photo_dir() -> Path:
    """The folder of scikit-image's bundled sample images."""
    import skimage

    return Path(skimage.__file__).parent / "data"


def photo_bytes(name: str) -> bytes:
    """The raw file bytes of one bundled photo (e.g. ``"astronaut.png"``)."""
    return (photo_dir() / name).read_bytes()


def data_uri(data: bytes, mime: str) -> str:
    """A ``data:<mime>;base64,...`` URI for ``image_url`` content parts."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def photo_uri(name: str) -> str:
    """A data URI of one bundled photo, with its MIME type."""
    return data_uri(photo_bytes(name), PHOTOS[name])


def resized_png(data: bytes, longest_side: int, crop: int = 0, stamp: int | None = None) -> bytes:
    """``data`` (any format Pillow reads) as RGB PNG bytes, cropped by ``crop`` pixels on the right and
    bottom, scaled so its longest side is ``longest_side`` pixels (aspect ratio kept), and, with
    ``stamp`` (0 to 2**24 - 1), that number written into the top-left pixel: a distinct image (new content
    hash: no prefix- or encoder-cache reuse) per stamp."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        rgb = rgb.crop((0, 0, max(1, rgb.width - crop), max(1, rgb.height - crop)))
        scale = longest_side / max(rgb.size)
        rgb = rgb.resize((max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale))))
        if stamp is not None:
            rgb.putpixel((0, 0), ((stamp >> 16) & 255, (stamp >> 8) & 255, stamp & 255))
        buf = io.BytesIO()
        rgb.save(buf, format="PNG")
    return buf.getvalue()


def folder_images(folder: Path) -> dict[str, bytes]:
    """The PNG, JPEG and WebP files directly in ``folder``, by file name (sorted).

    Raises:
        FileNotFoundError: ``folder`` holds no such file.
    """
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in {".png", ".jpg", ".jpeg", ".webp"})
    if not files:
        raise FileNotFoundError(f"no .png/.jpg/.jpeg/.webp file in {folder}")
    return {p.name: p.read_bytes() for p in files}


def variant_uri(name: str, index: int) -> str:
    """A PNG data URI of ``name`` cropped by ``index`` pixels on the right and bottom: a different image
    (new content hash, so no prefix-cache or encoder-cache reuse across variants) with a slightly
    different size, hence a different number of image tokens. ``index`` 0 is the photo re-encoded."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(photo_bytes(name))) as img:
        rgb = img.convert("RGB")
        cropped = rgb.crop((0, 0, rgb.width - index, rgb.height - index))
        buf = io.BytesIO()
        cropped.save(buf, format="PNG")
    return data_uri(buf.getvalue(), "image/png")
