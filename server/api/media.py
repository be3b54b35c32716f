"""Media checks on an OpenAI request body, before anything reaches vLLM (pure functions, no I/O).

Every multimodal content part (``image_url``, ``input_image``, ``video_url``, ``audio_url``,
``input_audio``) of a chat or responses request is checked by URL scheme:

* ``data:`` URIs must be well-formed base64, non-empty and at most ``max_image_bytes`` decoded; images
  are opened header-only (no pixel decoding) to check ``width x height`` against ``max_image_pixels``
  (decompression bombs are refused before anything decodes them) and the aspect ratio against
  ``max_aspect_ratio`` (Qwen's processor refuses above 200);
* ``http(s):`` image URLs only when remote media is enabled (``--guard-remote-media on``); vlguard then
  fetches them itself under its policy (:mod:`server.api.remote_media`) and vLLM never sees the URL;
* ``file:`` URLs only when ``--allowed-local-media-path`` is set (vLLM then confines them to it);
* any other scheme is refused.

Images smaller than the model's patch grid are not refused: Qwen3-VL's processor upscales them to its
minimum pixel count.

Each problem raises :class:`MediaError` (HTTP status + a message naming the part and the problem).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

#: Content-part types that carry media -> the key holding their URL (or inline data). The responses
#: API's ``input_image`` keeps its URL under ``image_url`` as a plain string.
MEDIA_PARTS = {
    "image_url": "image_url",
    "input_image": "image_url",
    "video_url": "video_url",
    "audio_url": "audio_url",
    "input_audio": "input_audio",
}


class MediaError(ValueError):
    """A content part that vlguard refuses. ``status`` is the HTTP status to answer with."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class MediaLimits:
    """Limits applied to every media part (bytes are decoded bytes)."""

    max_image_bytes: int
    max_image_pixels: int
    max_aspect_ratio: float
    remote_media: bool
    local_media: bool


def media_parts(body: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """``(where, kind, url_or_data_uri)`` for every media part of a chat (``messages``) or responses
    (``input``) request body. ``where`` names the part, e.g. ``messages[0].content[1]``."""
    for key in ("messages", "input"):
        turns = body.get(key)
        if not isinstance(turns, list):
            continue
        for i, turn in enumerate(turns):
            content = turn.get("content") if isinstance(turn, dict) else None
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in MEDIA_PARTS:
                    continue
                kind = str(part["type"])
                value = part.get(MEDIA_PARTS[kind])
                if kind == "input_audio" and isinstance(value, dict):
                    url = f"data:audio/{value.get('format', 'wav')};base64,{value.get('data', '')}"
                elif isinstance(value, dict):
                    url = str(value.get("url", ""))
                else:
                    url = str(value or "")
                yield f"{key}[{i}].content[{j}]", kind, url


def _decode_data_uri(where: str, url: str, limits: MediaLimits) -> tuple[str, bytes]:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: malformed data URI (expected data:<type>;base64,<data>)")
    if not payload.strip():
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: empty data URI (no data after the comma)")
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise MediaError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"{where}: media is {len(payload) * 3 // 4} bytes, more than the limit of {limits.max_image_bytes}",
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: invalid base64 in data URI ({exc})") from None
    return header.removesuffix(";base64"), data


def check_image_bytes(where: str, data: bytes, limits: MediaLimits) -> str:
    """Check an encoded image from its header and its container's checksums (no pixel decoding; Pillow's
    ``verify()``: for PNG every chunk's CRC, so corrupt pixel data is refused here on every vLLM version,
    where some versions' loaders would decode it into wrong pixels). Returns its MIME type.

    Raises:
        MediaError: 400 when unreadable or corrupt, too many pixels, or too elongated.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            width, height = img.size
            mime = Image.MIME.get(img.format or "", "application/octet-stream")
            img.verify()
    except Image.DecompressionBombError as exc:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: image refused as a decompression bomb ({exc})") from None
    except Exception as exc:  # Pillow's parsers raise OSError, SyntaxError, ValueError, EOFError, struct.error...
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: not a readable image ({exc})") from None
    if width * height > limits.max_image_pixels:
        raise MediaError(
            HTTPStatus.BAD_REQUEST,
            f"{where}: image is {width}x{height} = {width * height} pixels, more than the limit of "
            f"{limits.max_image_pixels}",
        )
    if max(width, height) > limits.max_aspect_ratio * min(width, height):
        raise MediaError(
            HTTPStatus.BAD_REQUEST,
            f"{where}: image is {width}x{height}, an aspect ratio above the limit of {limits.max_aspect_ratio:g}",
        )
    return mime


def check_media(body: dict[str, Any], limits: MediaLimits) -> int:
    """Check every media part of ``body``.

    Returns:
        The number of media parts checked.

    Raises:
        MediaError: the first part that is refused (400, or 413 for an oversized one).
    """
    count = 0
    for where, kind, url in media_parts(body):
        count += 1
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            mime, data = _decode_data_uri(where, url, limits)
            if kind in ("image_url", "input_image") or mime.startswith("image/"):
                check_image_bytes(where, data, limits)
        elif scheme in ("http", "https"):
            if not limits.remote_media:
                raise MediaError(
                    HTTPStatus.BAD_REQUEST,
                    f"{where}: remote media URLs are disabled on this server; send the {kind} as a data: URI "
                    "(operators: --guard-remote-media on)",
                )
            if kind not in ("image_url", "input_image"):
                raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: remote {kind} URLs are not supported; use data:")
        elif scheme == "file":
            if not limits.local_media:
                raise MediaError(
                    HTTPStatus.BAD_REQUEST,
                    f"{where}: local file URLs are refused (operators: --allowed-local-media-path DIR)",
                )
        else:
            raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: unsupported {kind} URL {url[:40]!r}")
    return count
