"""Media checks on an OpenAI request body, before anything reaches vLLM (pure functions, no I/O).

First the media items are counted per modality against vLLM's per-prompt limit
(``--limit-mm-per-prompt``): more items than allowed are refused before anything is decoded or fetched.
Then every multimodal content part (``image_url``, ``input_image``, ``video_url``, ``audio_url``,
``input_audio``) of a chat or responses request is checked by URL scheme:

* ``data:`` URIs must be well formed, non-empty and at most ``max_image_bytes`` decoded; other media than
  images must be valid base64 too. An image is read no further here: vLLM's media layer, where every
  route's images are loaded, checks its base64 and opens it header-only before decoding, to check
  ``width x height`` against ``max_image_pixels`` (decompression bombs are refused before anything
  decodes them) and the aspect ratio against ``max_aspect_ratio`` (Qwen's processor refuses above 200)
  (:mod:`server.api.media_policy`);
* ``http(s):`` image URLs only when remote media is enabled (``--guard-remote-media on``); vlguard then
  fetches them itself under its policy (:mod:`server.api.remote_media`) and vLLM never sees the URL;
* ``file:`` URLs only when ``--allowed-local-media-path`` is set (vLLM then confines them to it);
* any other scheme is refused;
* ``mm_processor_kwargs`` may only lower the processed image size within the server's bounds
  (:func:`requested_pixel_bounds`), checked before any pixel work.

Images are normalised (:mod:`server.api.pixels`) where vLLM loads them, not here
(:meth:`server.api.media_policy.MediaPolicy.image_bytes`).

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
from typing import Any, NamedTuple

import pybase64  # vLLM's own base64 codec (SIMD): ~60x the standard library's on a 120 KB image

from server.api.pixels import needs_normalizing, normalize_image

#: Content-part types that carry media -> the key holding their URL (or inline data). The responses
#: API's ``input_image`` keeps its URL under ``image_url`` as a plain string.
MEDIA_PARTS = {
    "image_url": "image_url",
    "input_image": "image_url",
    "video_url": "video_url",
    "audio_url": "audio_url",
    "input_audio": "input_audio",
}


#: The modality vLLM counts a part kind under for its per-prompt limit (``--limit-mm-per-prompt``).
MODALITY = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
}


class MediaError(ValueError):
    """A request part that vlguard refuses. ``status`` is the HTTP status to answer with, ``reason`` the
    ``vlguard_requests_rejected_total`` label."""

    def __init__(self, status: HTTPStatus, message: str, reason: str = "media") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class MediaLimits:
    """Limits applied to every media part (bytes are decoded bytes)."""

    max_image_bytes: int
    max_image_pixels: int
    max_aspect_ratio: float
    remote_media: bool
    local_media: bool
    normalize: bool = False
    upstream_rules: frozenset[str] = frozenset()
    trust_client_uuids: bool = False


@dataclass(frozen=True)
class PixelBounds:
    """The processed image size the server allows (pixels after the processor's resize): its
    ``min_pixels``/``max_pixels`` (Qwen's ``size.shortest_edge``/``size.longest_edge``)."""

    min_pixels: int
    max_pixels: int


#: The server's bounds before its engine first came up (the model's processor not read yet).
BOUNDS_PENDING = PixelBounds(0, 0)


@dataclass(frozen=True)
class MediaPart:
    """One media content part: ``where`` names it (``messages[0].content[1]``), ``url`` is its URL or
    data URI; ``holder[key]`` is where the URL lives in the body (``replace`` rewrites it)."""

    where: str
    kind: str
    url: str
    holder: dict[str, Any]
    key: str

    @property
    def is_image(self) -> bool:
        return self.kind in ("image_url", "input_image")

    def replace(self, url: str) -> None:
        self.holder[self.key] = url


class MediaCheck(NamedTuple):
    """What :func:`check_media` found: the media parts checked."""

    parts: int


#: The keys vLLM's chat parser reads a part by when it has no ``type``, or has a ``uuid``, in its order
#: (``vllm.entrypoints.chat_utils._parse_chat_message_content_mm_part``; ``input_audio`` only when not None).
UNTYPED_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds", "audio_url", "input_audio", "video_url")
#: Parts that carry no encoded media a door can check (raw tensors, in-process images): refused.
UNCHECKABLE = ("image_pil", "image_embeds", "audio_embeds")


def _media_kind(part: Any) -> str | None:
    """The media kind vLLM will read ``part`` as, or None: by its ``type``, or, with no ``type`` or with a
    ``uuid``, by the first of :data:`UNTYPED_KEYS` it holds, exactly as vLLM's chat parser does (a part
    ``{"video_url": ...}`` with no type is a video; ``{"type": "text", "uuid": ..., "image_url": ...}`` is
    an image)."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        for key in UNTYPED_KEYS:
            if key in part and (key != "input_audio" or part[key] is not None):
                return key
        return None
    return kind if isinstance(kind, str) and (kind in MEDIA_PARTS or kind in UNCHECKABLE) else None


def content_parts(body: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(where, part)`` for every content part of a chat (``messages``) or responses (``input``) request
    body, in order (``where``: ``messages[0].content[1]``)."""
    for key in ("messages", "input"):
        turns = body.get(key)
        if not isinstance(turns, list):
            continue
        for i, turn in enumerate(turns):
            content = turn.get("content") if isinstance(turn, dict) else None
            if isinstance(content, list):
                for j, part in enumerate(content):
                    yield f"{key}[{i}].content[{j}]", part


def media_parts(body: dict[str, Any]) -> Iterator[MediaPart]:
    """Every media part of a chat (``messages``) or responses (``input``) request body, in order."""
    for where, part in content_parts(body):
        kind = _media_kind(part)
        if kind is None:
            continue
        if kind in UNCHECKABLE:
            raise MediaError(
                HTTPStatus.BAD_REQUEST, f"{where}: {kind} parts are not accepted; send media as data: URIs"
            )
        field = MEDIA_PARTS[kind]
        value = part.get(field)
        holder, attr = (value, "url") if isinstance(value, dict) else (part, field)
        if kind == "input_audio" and isinstance(value, dict):
            url = f"data:audio/{value.get('format', 'wav')};base64,{value.get('data', '')}"
            holder, attr = part, field  # not rewritable as a URL; audio is never normalised
        else:
            url = str(holder.get(attr) or "")
        yield MediaPart(where, kind, url, holder, attr)


def count_items(body: dict[str, Any], item_limits: dict[str, int]) -> dict[str, int]:
    """Count ``body``'s media items per modality, as vLLM's chat parser counts them, and check them against
    the per-prompt limits (``--limit-mm-per-prompt``: modality -> most items; a modality not listed is not
    limited here). Nothing is decoded: a request with more items than allowed is refused before any
    base64 decoding, header read, pixel work or remote fetch.

    Returns:
        modality -> number of items.

    Raises:
        MediaError: 400 naming the modality, the limit and the count.
    """
    counts: dict[str, int] = {}
    for _, part in content_parts(body):
        kind = _media_kind(part)
        if kind is not None:
            modality = MODALITY[kind]
            counts[modality] = counts.get(modality, 0) + 1
    for modality, count in counts.items():
        limit = item_limits.get(modality)
        if limit is not None and count > limit:
            raise MediaError(
                HTTPStatus.BAD_REQUEST,
                f"At most {limit} {modality}(s) may be provided in one prompt; this request has {count}",
                "media_count",
            )
    return counts


def strip_client_uuids(body: dict[str, Any]) -> int:
    """Drop the ``uuid`` of every media part (in place): vLLM trusts a client's ``uuid`` as the item's
    identity in its caches, so the same ``uuid`` with another image was answered about the first one, and
    a client that learnt another's ``uuid`` could ask about that client's picture (vllm#55547, PR #53471).
    Without it vLLM hashes the content itself. Returns how many were dropped.

    Raises:
        MediaError: 400 for a part with a ``uuid`` and no content (it would stand for a cached item).
    """
    dropped = 0
    for where, part in content_parts(body):
        if not isinstance(part, dict) or "uuid" not in part:
            continue
        kind = _media_kind(part)
        if part["uuid"] is not None and (kind is None or not part.get(kind)):
            raise MediaError(
                HTTPStatus.BAD_REQUEST, f"{where}: a uuid without the media itself is not accepted; send the media"
            )
        del part["uuid"]
        dropped += 1
    return dropped


def url_scheme(url: str) -> str:
    """``url``'s scheme in lower case ("" without one); ``url`` is not copied (a ``data:`` URL is up to
    the body's size)."""
    colon = url.find(":", 0, 16)  # no scheme vLLM or vlguard serves is longer
    return url[:colon].lower() if colon >= 0 else ""


def _data_uri_payload(where: str, url: str, limits: MediaLimits) -> tuple[str, int]:
    """A ``data:`` URI's MIME type and where its base64 payload starts, its form and size checked (nothing
    decoded, nothing copied: a payload is up to the body's size)."""
    comma = url.find(",", len("data:"))
    header = url[len("data:") : comma] if comma >= 0 else ""
    if comma < 0 or not header.endswith(";base64"):
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: malformed data URI (expected data:<type>;base64,<data>)")
    size = len(url) - comma - 1
    if size == 0 or (url[comma + 1].isspace() and url[comma + 1 :].isspace()):  # copied only when it may be
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: empty data URI (no data after the comma)")
    if size * 3 // 4 > limits.max_image_bytes:
        raise MediaError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"{where}: media is {size * 3 // 4} bytes, more than the limit of {limits.max_image_bytes}",
        )
    return header.removesuffix(";base64"), comma + 1


def _decode_payload(where: str, url: str, at: int) -> bytes:
    payload = url[at:]
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(
            HTTPStatus.BAD_REQUEST, f"{where}: invalid base64 in data URI ({base64_error(payload)})"
        ) from None


def _decode_data_uri(where: str, url: str, limits: MediaLimits) -> tuple[str, bytes]:
    mime, at = _data_uri_payload(where, url, limits)
    return mime, _decode_payload(where, url, at)


def base64_error(payload: str) -> str:
    """What is wrong with ``payload``, in the standard library's words ("Incorrect padding", "Only base64
    data is allowed"): pybase64 says "Non-base64 digit found" for every fault. Only on refusal."""
    try:
        base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        return str(exc)
    return "refused by the decoder"


class ImageHeader(NamedTuple):
    """What an image's header says: its MIME type, the normalisation rules that apply to it, and its
    pixel count (``width x height``)."""

    mime: str
    rules: list[str]
    pixels: int


def check_image_bytes(
    where: str, data: bytes, limits: MediaLimits, rules: bool = False, checksums: bool = True
) -> ImageHeader:
    """Check an encoded image from its header and, with ``checksums``, its container's checksums (no pixel
    decoding; Pillow's ``verify()``: for PNG every chunk's CRC, so corrupt pixel data is refused on every vLLM
    version, where some versions' loaders would decode it into wrong pixels). Run where vLLM loads the
    image (the media policy in its connector), once; a remote image the door fetches is read header-only.

    Returns:
        the image's :class:`ImageHeader`; its ``rules`` are read only when ``rules`` and
        ``limits.normalize`` are set (:func:`server.api.pixels.needs_normalizing`, from the same header).

    Raises:
        MediaError: 400 when unreadable or corrupt, too many pixels, or too elongated.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            width, height = img.size
            mime = Image.MIME.get(img.format or "", "application/octet-stream")
            applying = needs_normalizing(img, limits.upstream_rules) if rules and limits.normalize else []
            if checksums:
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
    return ImageHeader(mime, applying, width * height)


def normalized_image(where: str, data: bytes, limits: MediaLimits) -> bytes | None:
    """Normalise one image that passed :func:`check_image_bytes` (:func:`server.api.pixels.normalize_image`):
    decodes its pixels, so it runs in the media policy's decode pool (:mod:`server.api.decode_pool`).

    Returns:
        the normalised PNG when a rule applied, else None.

    Raises:
        MediaError: 400 when its pixels cannot be decoded.
    """
    try:
        return normalize_image(data, limits.upstream_rules)
    except Exception as exc:  # Pillow's decoders raise OSError, ValueError, SyntaxError...
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: image pixels cannot be decoded ({exc})") from None


def checked_image(where: str, data: bytes, limits: MediaLimits) -> tuple[str, bytes | None]:
    """Check one encoded image (:func:`check_image_bytes`) and, with ``limits.normalize``, normalise it.

    Returns:
        ``(mime, normalized)``: its MIME type, and the normalised PNG when a rule applied (else None).

    Raises:
        MediaError: 400 when refused by the checks or its pixels cannot be decoded.
    """
    header = check_image_bytes(where, data, limits, rules=True)
    return header.mime, normalized_image(where, data, limits) if header.rules else None


def data_uri(mime: str, data: bytes) -> str:
    """``data`` as a base64 ``data:`` URI of type ``mime``."""
    return f"data:{mime};base64,{pybase64.b64encode(data).decode('ascii')}"


def check_media(
    body: dict[str, Any],
    limits: MediaLimits,
    pixel_bounds: PixelBounds | None = None,
    item_limits: dict[str, int] | None = None,
) -> MediaCheck:
    """Check ``body``'s media without decoding any pixels: first the number of items per modality against
    ``item_limits`` (:func:`count_items`, before anything is decoded), then, given the server's
    ``pixel_bounds``, its ``mm_processor_kwargs`` (503 while they are :data:`BOUNDS_PENDING`), then every
    part: URL scheme, and a ``data:`` URI's form and size (a ``data:`` image is read no further here:
    its base64, header, pixels and checksums are checked, and it is normalised, where vLLM loads it:
    :class:`server.api.media_policy.MediaPolicy`). Nothing in ``body`` is changed.

    Returns:
        the parts checked.

    Raises:
        MediaError: the first part that is refused (400, or 413 for an oversized one; 503 for
            ``mm_processor_kwargs`` before the bounds are known).
    """
    if item_limits is not None:
        count_items(body, item_limits)
    if pixel_bounds is BOUNDS_PENDING and body.get("mm_processor_kwargs") is not None:
        raise MediaError(
            HTTPStatus.SERVICE_UNAVAILABLE, "the engine is starting: mm_processor_kwargs cannot be checked yet"
        )
    if pixel_bounds is not None:
        requested_pixel_bounds(body.get("mm_processor_kwargs"), pixel_bounds)
    count = 0
    for part in media_parts(body):
        where, kind, url = part.where, part.kind, part.url
        count += 1
        scheme = url_scheme(url)
        if scheme == "data" and part.is_image:  # its header, checksums and pixels: where vLLM loads it
            _data_uri_payload(where, url, limits)
        elif scheme == "data":
            mime, data = _decode_data_uri(where, url, limits)
            if mime.startswith("image/"):
                check_image_bytes(where, data, limits, checksums=False)
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
    return MediaCheck(count)


#: ``mm_processor_kwargs`` keys a request may set: the processed-size bounds of Qwen's image processor.
SIZE_KWARGS = ("min_pixels", "max_pixels")
SIZE_EDGE_KWARGS = {"shortest_edge": "min_pixels", "longest_edge": "max_pixels"}


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where} must be a positive integer (pixels), got {value!r}")
    return value


def requested_pixel_bounds(kwargs: Any, server: PixelBounds) -> PixelBounds:
    """The processed-size bounds a request's ``mm_processor_kwargs`` ask for, checked against the server's.

    A request may lower the resolution (``max_pixels``, or ``size`` with both edges) and move
    ``min_pixels`` within the server's bounds; nothing else: keys that change the patch grid or
    anything unknown are refused, so every processed image stays within ``server.max_pixels``.

    Raises:
        MediaError: 400 naming the key and the server's bound.
    """
    if kwargs is None:
        return server
    if not isinstance(kwargs, dict):
        raise MediaError(HTTPStatus.BAD_REQUEST, "mm_processor_kwargs must be an object")
    asked: dict[str, int] = {}
    for key, value in kwargs.items():
        if key in SIZE_KWARGS:
            asked[key] = _positive_int(f"mm_processor_kwargs.{key}", value)
        elif key == "size" and isinstance(value, dict) and set(value) <= set(SIZE_EDGE_KWARGS):
            if set(value) != set(SIZE_EDGE_KWARGS):  # it replaces the server's size whole: both are needed
                raise MediaError(
                    HTTPStatus.BAD_REQUEST,
                    "mm_processor_kwargs.size needs both shortest_edge and longest_edge (or use min_pixels/max_pixels)",
                )
            for edge, name in SIZE_EDGE_KWARGS.items():
                asked[name] = _positive_int(f"mm_processor_kwargs.size.{edge}", value[edge])
        else:
            allowed = ", ".join([*SIZE_KWARGS, "size.shortest_edge", "size.longest_edge"])
            raise MediaError(
                HTTPStatus.BAD_REQUEST,
                f"mm_processor_kwargs.{key} may not be set per request on this server (allowed: {allowed})",
            )
    bounds = PixelBounds(asked.get("min_pixels", server.min_pixels), asked.get("max_pixels", server.max_pixels))
    for name, value in (("max_pixels", bounds.max_pixels), ("min_pixels", bounds.min_pixels)):
        if value > server.max_pixels:
            raise MediaError(
                HTTPStatus.BAD_REQUEST,
                f"mm_processor_kwargs {name}={value} is above this server's processed image bound of "
                f"{server.max_pixels} pixels; a request may only lower the resolution",
            )
    if bounds.min_pixels > bounds.max_pixels:
        raise MediaError(
            HTTPStatus.BAD_REQUEST,
            f"mm_processor_kwargs min_pixels={bounds.min_pixels} is above max_pixels={bounds.max_pixels}",
        )
    return bounds


def server_pixel_bounds(processor_config: dict[str, Any], server_kwargs: dict[str, Any] | None) -> PixelBounds | None:
    """The server's processed-size bounds: the model's ``preprocessor_config.json`` (``min_pixels``/
    ``max_pixels``, or ``size.shortest_edge``/``size.longest_edge``) overridden by ``--mm-processor-kwargs``.
    ``None`` when the model's processor states no such bounds (not a Qwen-style processor)."""
    found: dict[str, int] = {}
    for source in (processor_config, server_kwargs or {}):
        size = source["size"] if isinstance(source.get("size"), dict) else {}
        for edge, name in SIZE_EDGE_KWARGS.items():
            if isinstance(size.get(edge), int):
                found[name] = size[edge]
        for name in SIZE_KWARGS:
            if isinstance(source.get(name), int):
                found[name] = source[name]
    if "max_pixels" not in found:
        return None
    return PixelBounds(found.get("min_pixels", 1), found["max_pixels"])
