"""The media policy every image and video frame meets inside vLLM's media layer, whatever carried it.

The door (:mod:`server.api.media`) reads the request shapes it knows and refuses early; this policy is what
keeps media out: vLLM loads every media item of every route and part shape (chat parts, Responses input
items and tool outputs, render, ``/tokenize``, shapes a later vLLM adds) through its media connector, and
vlguard's connector (:mod:`server.vllm_hooks.media_connector`) applies this policy there:

* **schemes before any connection**: ``http(s)`` only for images and only with ``--guard-remote-media on``,
  fetched by vlguard (each redirect hop's host in ``--allowed-media-domains`` and every address it resolves
  to public, the bytes bounded while they arrive); ``file:`` only with
  ``--allowed-local-media-path``; ``data:`` always; anything else refused;
* **bytes and pixels before decoding**: an image (and each ``video/jpeg`` frame) at most ``max_image_mb``
  decoded, its ``width x height`` read from its header at most ``max_image_pixels``, its aspect ratio at
  most ``max_aspect_ratio``; a container video's frame size read from its header the same way;
* **the picture people see** (``--guard-image-normalize on``): an image a rule of :mod:`server.api.pixels`
  applies to (EXIF orientation, transparency, 16/32-bit) is normalised before vLLM decodes it, in the
  bounded decode pool (:mod:`server.api.decode_pool`); every other image is loaded byte for byte. Video
  frames are not normalised;
* **frame count**: a video decodes at most ``--guard-max-video-frames`` frames, and its frames together at
  most :data:`VIDEO_PIXELS_PER_IMAGE` times ``max_image_pixels`` (each frame alone may be as large as an
  image: 12 frames of 7000x7000 took 5.3 GB);
* **per-request ``media_io_kwargs``**: only ``video.num_frames`` (1 to the frame bound) and ``video.fps``
  (above 0, at most :data:`MAX_FPS`) may differ from the server's ``--media-io-kwargs``; anything else a
  request sets (``video_backend``, ``num_frames: -1``, image options) is refused.

Each refusal raises :class:`~server.api.media.MediaError` (a ``ValueError``: vLLM answers it 400 with its
message). Checks are pure functions, with one probe of a video container's header (OpenCV, as vLLM's loader
reads it); normalisation runs in the policy's decode pool, which the app's lifespan shuts down.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import pybase64

from server.api.decode_pool import DecodePool
from server.api.image_cache import DecodedImageCache
from server.api.media import (
    ImageHeader,
    MediaError,
    MediaLimits,
    base64_error,
    check_image_bytes,
    normalized_image,
    url_scheme,
)
from server.api.remote_media import RemotePolicy, fetch_bytes
from server.guard.clients import current_client
from server.settings import GuardSettings
from server.vllm_hooks.locations import upstream_decode_budget, upstream_image_rules

logger = logging.getLogger(__name__)

#: A video's frames together may hold this many times the largest image's pixels (32 frames of 1080p fit).
VIDEO_PIXELS_PER_IMAGE = 2
#: The highest frame rate a request may ask a video to be sampled at.
MAX_FPS = 60.0

#: What a request may set in ``media_io_kwargs`` beyond the server's own values, by modality.
REQUEST_IO_KEYS = {"video": ("num_frames", "fps")}


def _refuse(message: str) -> MediaError:
    return MediaError(HTTPStatus.BAD_REQUEST, message)


@dataclass(frozen=True)
class MediaPolicy:
    """What vLLM's media layer may load (see the module docstring).

    Attributes:
        limits: the door's media limits (bytes, pixels, aspect ratio, remote and local media).
        remote: the remote-media host policy (used with ``limits.remote_media`` only).
        max_video_frames: the most frames one video may decode.
        decoder: the decode pool images are normalised in.
        server_io_kwargs: the server's ``--media-io-kwargs`` (modality -> kwargs): the operator's values.
        image_cache: decoded images kept by their bytes' hash (off unless given).
    """

    limits: MediaLimits
    remote: RemotePolicy
    max_video_frames: int
    decoder: DecodePool = field(compare=False)
    server_io_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    image_cache: DecodedImageCache = field(compare=False, default_factory=lambda: DecodedImageCache(0))

    @classmethod
    def of(cls, settings: GuardSettings, args: Any) -> MediaPolicy:
        """The policy of a server started with ``settings`` and vLLM's serve arguments ``args``: one object for
        the door (:class:`server.api.input_guard.InputGuardMiddleware`) and vLLM's media connector."""
        limits = MediaLimits(
            max_image_bytes=int(settings.max_image_mb * 1024 * 1024),
            max_image_pixels=settings.max_image_pixels,
            max_aspect_ratio=settings.max_aspect_ratio,
            remote_media=settings.remote_media,
            local_media=bool(getattr(args, "allowed_local_media_path", None)),
            normalize=settings.image_normalize,
            upstream_rules=upstream_image_rules(),
            trust_client_uuids=settings.trust_client_uuids,
        )
        hosts = frozenset(h.lower() for h in getattr(args, "allowed_media_domains", None) or ())
        remote = RemotePolicy(allowed_hosts=hosts, timeout_s=settings.remote_media_timeout)
        io_kwargs = dict(getattr(args, "media_io_kwargs", None) or {})
        decoder = DecodePool(settings.decode_threads, settings.decode_pixel_budget())
        cache_bytes = int(settings.image_cache_mb * 1024 * 1024)
        if cache_bytes and upstream_decode_budget():  # a hit would skip the request's charge
            logger.warning("--guard-image-cache-mb: off on this vLLM, which charges each request's decoded bytes "
                           "to a budget of the request's own (VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES)")  # fmt: skip
            cache_bytes = 0
        cache = DecodedImageCache(cache_bytes)
        return cls(limits, remote, settings.max_video_frames, decoder, io_kwargs, cache)

    def check_url(self, modality: str, url: str) -> str:
        """The URL's scheme (lower case), once ``modality``'s policy allows it; checked before any
        connection or decoding.

        Raises:
            MediaError: remote media off (or not an image), ``file:`` without a local media path, or any
                other scheme.
        """
        if url[:1].isspace() or url[-1:].isspace():
            raise _refuse(f"{modality}: URL has surrounding whitespace")
        scheme = url_scheme(url)  # nothing here copies the URL: a data URL is up to the body's size
        if scheme == "data":
            comma = url.find(",")
            if comma < 0 or not url[:comma].lower().endswith(";base64"):
                raise _refuse(f"{modality}: a data URL must be data:<type>;base64,<data>")
            # a data URL has neither (base64, a media type): vLLM's URL parser would cut the URL there
            if "#" in url or "?" in url:
                raise _refuse(f"{modality}: a data URL's data must be base64 only (it holds '#' or '?')")
        if scheme in ("http", "https"):
            if not self.limits.remote_media:
                raise _refuse(f"{modality}: remote media URLs are refused on this server (--guard-remote-media off)")
            if modality != "image":
                raise _refuse(f"{modality}: only images are fetched from remote URLs")
            return scheme
        if scheme == "file" and not self.limits.local_media:
            raise _refuse(f"{modality}: file URLs need --allowed-local-media-path")
        if scheme not in ("data", "file"):
            raise _refuse(
                f"{modality}: URL scheme {scheme or '(none)'!r} is not allowed (data, or http(s) when enabled)"
            )
        return scheme

    async def fetch(self, url: str) -> bytes:
        """A remote image's bytes, fetched by vlguard (:func:`server.api.remote_media.fetch_bytes`: each
        redirect hop's host and addresses checked, at most ``max_image_mb`` read, within the timeout),
        never by vLLM's own fetch (which follows redirects unchecked and reads any size).

        Raises:
            MediaError: as ``fetch_bytes``.
        """
        return await fetch_bytes("image", url, self.limits.max_image_bytes, self.remote)

    def check_io_kwargs(self, merged: dict[str, dict[str, Any]] | None) -> None:
        """Check a request's ``media_io_kwargs`` merged over the server's (what vLLM's connector gets).

        Raises:
            MediaError: a value the request set that is not allowed (see the module docstring).
        """
        for modality, kwargs in (merged or {}).items():
            server = self.server_io_kwargs.get(modality) or {}
            for key, value in (kwargs or {}).items():
                if key in server and server[key] == value:
                    continue  # the operator's own value
                if key not in REQUEST_IO_KEYS.get(modality, ()):
                    raise _refuse(f"media_io_kwargs.{modality}.{key} may not be set per request")
                self._check_io_value(modality, key, value)

    def _check_io_value(self, modality: str, key: str, value: Any) -> None:
        if key == "num_frames":
            if type(value) is not int or not 1 <= value <= self.max_video_frames:
                raise _refuse(
                    f"media_io_kwargs.{modality}.num_frames must be an integer from 1 to {self.max_video_frames}"
                )
        elif type(value) not in (int, float) or not (0 < value <= MAX_FPS and math.isfinite(value)):
            raise _refuse(f"media_io_kwargs.{modality}.{key} must be a number above 0 and at most {MAX_FPS:g}")

    def image_bytes(self, where: str, data: bytes, rules: bool = False) -> ImageHeader:
        """Check an encoded image (or video frame) before it is decoded.

        Arguments:
            rules: read the normalisation rules that apply to it too (with ``limits.normalize``).
        Returns:
            its header (:class:`~server.api.media.ImageHeader`); ``rules`` empty when it is loaded as sent.
        Raises:
            MediaError: too many bytes (413 at the door, 400 through vLLM), unreadable, too many pixels, too
                elongated.
        """
        if len(data) > self.limits.max_image_bytes:
            message = f"{where}: {len(data)} bytes, more than the limit of {self.limits.max_image_bytes}"
            raise MediaError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message)
        return check_image_bytes(where, data, self.limits, rules=rules)

    def normalized(self, where: str, data: bytes) -> bytes:
        """An image :meth:`image_bytes` found rules for, normalised on the calling thread (vLLM's
        synchronous loading path, which its OpenAI server does not take: :meth:`normalized_async`).

        Raises:
            MediaError: 400 when its pixels cannot be decoded.
        """
        return normalized_image(where, data, self.limits) or data

    async def normalized_async(self, where: str, data: bytes, pixels: int) -> bytes:
        """:meth:`normalized` in the decode pool (:mod:`server.api.decode_pool`): its own threads, within
        its pixel budget (``pixels``: the image's ``width x height``), taking turns with other clients' images
        (the request's client: :data:`server.guard.clients.current_client`); the caller waits holding no
        thread.

        Raises:
            MediaError: 400 when its pixels cannot be decoded.
        """
        return await self.decoder.run(pixels, self.normalized, where, data, client=current_client.get())

    def base64_payload(self, where: str, payload: str) -> bytes:
        """Decode a base64 payload whose decoded size is within the image byte bound (checked first).

        Raises:
            MediaError: too large, or not base64.
        """
        if len(payload) * 3 // 4 > self.limits.max_image_bytes + 2:
            raise _refuse(f"{where}: more than {self.limits.max_image_bytes} bytes")
        try:
            return pybase64.b64decode(payload, validate=True)
        except ValueError:
            raise _refuse(f"{where}: invalid base64 in data URI ({base64_error(payload)})") from None

    def frames(self, where: str, count: int) -> None:
        """Check that a video decodes at most the frame bound (``count``: the frames vLLM would decode).

        Raises:
            MediaError: more frames.
        """
        if count > self.max_video_frames:
            raise _refuse(f"{where}: {count} frames, more than the limit of {self.max_video_frames}")

    def video_pixels(self, where: str, pixels: int) -> None:
        """Check the pixels of a video's frames together (``pixels``: frames times each one's).

        Raises:
            MediaError: more than :data:`VIDEO_PIXELS_PER_IMAGE` times ``max_image_pixels``.
        """
        if pixels > (budget := VIDEO_PIXELS_PER_IMAGE * self.limits.max_image_pixels):
            raise _refuse(f"{where}: its frames hold {pixels} pixels together, more than the limit of {budget}")

    def video_container(self, where: str, data: bytes, num_frames: int) -> None:
        """Check a container video (mp4, webm, ...) from its header before any frame is decoded: its frame
        size against the pixel bound, the frames it would decode against the frame bound.

        Raises:
            MediaError: unreadable, frames too large, too many frames.
        """
        import io

        import cv2

        stream = io.BytesIO(data)  # referenced while the capture reads it
        capture = cv2.VideoCapture(stream, cv2.CAP_FFMPEG, [])  # type: ignore[call-overload]
        try:
            if not capture.isOpened():
                raise _refuse(f"{where}: not a readable video")
            width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
            height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
            total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        finally:
            capture.release()
        if width * height > self.limits.max_image_pixels:
            raise _refuse(f"{where}: frames of {width}x{height} = {width * height} pixels, more than the limit of "
                          f"{self.limits.max_image_pixels}")  # fmt: skip
        decoded = min(total, num_frames) if num_frames > 0 else total
        self.frames(where, decoded)
        self.video_pixels(where, decoded * width * height)
