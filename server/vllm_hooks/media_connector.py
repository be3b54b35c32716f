"""vLLM's media connector, with vlguard's media policy applied wherever vLLM loads media.

Every media item vLLM's front end loads (any route, any part or item shape) goes through the connector
``vllm.multimodal.media.MEDIA_CONNECTOR_REGISTRY`` names by ``VLLM_MEDIA_CONNECTOR`` (vLLM's own is
``http``). :func:`install` registers, under that name, a subclass of vLLM's connector that applies a
:class:`~server.api.media_policy.MediaPolicy` before vLLM does anything with a URL:

* the request's ``media_io_kwargs`` (merged over the server's) when the connector is built;
* the URL's scheme before any connection; a remote image (remote media on) is fetched by vlguard's own
  fetcher (each redirect hop checked, the bytes bounded as they arrive), never by vLLM's;
* the bytes of each image, each ``video/jpeg`` frame and each container video before they are decoded
  (the media IO object vLLM hands to its loaders is wrapped); an image a normalisation rule applies to
  is handed back from vLLM's loading thread and normalised in the decode pool
  (:mod:`server.api.decode_pool`), so that waiting for the pool holds none of vLLM's loading threads;
  any other image sent before is a copy of its earlier decode (:mod:`server.api.image_cache`).

With client uuids untrusted (the default), :func:`install` also makes vLLM's multimodal item trackers
forget the uuids a request named (vllm#55547: a uuid would answer about another picture): vLLM hashes the
content instead, whatever shape the uuid came in.

A connector other than vLLM's own (a plugin's) cannot carry the policy: :func:`install` refuses to start.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Protocol

from server.vllm_hooks.locations import wrap_item_trackers

#: The environment variable vLLM reads its connector's name from, and vLLM's own connector's name.
CONNECTOR_ENV, VLLM_CONNECTOR = "VLLM_MEDIA_CONNECTOR", "http"


class ImageHeader(Protocol):
    """What the policy read from an image's header (:class:`server.api.media.ImageHeader`)."""

    @property
    def rules(self) -> list[str]: ...  # the normalisation rules that apply to it (empty: loaded as sent)
    @property
    def pixels(self) -> int: ...


class ImageCache(Protocol):
    """Decoded images kept by their bytes (:class:`server.api.image_cache.DecodedImageCache`)."""

    def key(self, media_io: Any, data: bytes, pixels: int) -> Hashable | None: ...  # None: not cached
    def get(self, key: Hashable) -> Any | None: ...  # a copy of what was loaded, or None
    def put(self, key: Hashable, loaded: Any, data: bytes) -> None: ...


class MediaPolicy(Protocol):
    """What the connector asks of the policy (:class:`server.api.media_policy.MediaPolicy`); each method
    raises a ``ValueError`` (vLLM answers 400 with its message) when the item is refused."""

    def check_io_kwargs(self, merged: dict[str, dict[str, Any]] | None) -> None: ...
    def check_url(self, modality: str, url: str) -> str: ...
    async def fetch(self, url: str) -> bytes: ...
    def image_bytes(self, where: str, data: bytes, rules: bool = False) -> ImageHeader: ...
    def normalized(self, where: str, data: bytes) -> bytes: ...
    async def normalized_async(self, where: str, data: bytes, pixels: int) -> bytes: ...
    def base64_payload(self, where: str, payload: str) -> bytes: ...
    def frames(self, where: str, count: int) -> None: ...
    def video_pixels(self, where: str, pixels: int) -> None: ...
    def video_container(self, where: str, data: bytes, num_frames: int) -> None: ...
    @property
    def image_cache(self) -> ImageCache: ...


_policy: list[MediaPolicy] = []  # the policy the registered connector applies (the latest install's)
_trust_uuids = [False]  # the latest install's --guard-trust-client-uuids


def _current() -> MediaPolicy:
    if not _policy:
        raise RuntimeError("vlguard's media policy is not installed")
    return _policy[-1]


class _Deferred(Exception):
    """An image a normalisation rule applies to, handed back from vLLM's media loading thread to the
    connector's coroutine: it waits for the decode pool there, holding no loading thread."""

    def __init__(self, data: bytes, pixels: int) -> None:
        super().__init__("an image to normalise")
        self.data, self.pixels = data, pixels


class _CheckedImageIO:
    """An image media IO whose loads meet the policy first (``where``: ``image`` or ``video frame``).
    With ``normalize``, an image a normalisation rule applies to is normalised on the calling thread, or
    with ``defer`` handed back (:class:`_Deferred`) to be normalised in the decode pool."""

    def __init__(self, inner: Any, where: str, normalize: bool, defer: bool = False) -> None:
        self._inner, self._where, self._normalize, self._defer = inner, where, normalize, defer
        self.pixels = 0  # the pixels of the images loaded so far (a video's frames: bounded together)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_bytes(self, data: bytes) -> Any:
        policy = _current()
        header = policy.image_bytes(self._where, data, rules=self._normalize)
        if self._where == "video frame":
            self.pixels += header.pixels
            policy.video_pixels("video", self.pixels)
        if header.rules and self._defer:
            raise _Deferred(data, header.pixels)
        if header.rules:
            data = policy.normalized(self._where, data)
        elif self._where == "image":  # sent before: not decoded again (video frames: a video loads whole, once)
            return self._load_cached(policy.image_cache, data, header.pixels)
        return self._inner.load_bytes(data)

    def _load_cached(self, cache: ImageCache, data: bytes, pixels: int) -> Any:
        if (key := cache.key(self._inner, data, pixels)) is None:
            return self._inner.load_bytes(data)
        if (loaded := cache.get(key)) is None:
            loaded = self._inner.load_bytes(data)
            cache.put(key, loaded, data)
        return loaded

    def load_normalized(self, data: bytes) -> Any:
        """Load an image the policy has normalised (checked already)."""
        return self._inner.load_bytes(data)

    def load_base64(self, media_type: str, data: str) -> Any:
        return self.load_bytes(_current().base64_payload(self._where, data))

    def load_file(self, filepath: Path) -> Any:
        return self.load_bytes(Path(filepath).read_bytes())


class _CheckedVideoIO:
    """A video media IO whose loads meet the policy first: frame count, each ``video/jpeg`` frame as an
    image and the frames' pixels together, a container video's header."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._frames = _CheckedImageIO(inner.image_io, "video frame", normalize=False)  # as vLLM converts them
        inner.image_io = self._frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_bytes(self, data: bytes) -> Any:
        _current().video_container("video", data, int(self._inner.num_frames))
        return self._inner.load_bytes(data)

    def load_base64(self, media_type: str, data: str) -> Any:
        if media_type.lower() == "video/jpeg":  # frames decoded one by one through the checked image IO
            sent, asked = data.count(",") + 1, int(self._inner.num_frames)
            _current().frames("video", min(sent, asked) if asked > 0 else sent)
            self._frames.pixels = 0  # this video's frames, counted as they load
            return self._inner.load_base64(media_type, data)
        import pybase64

        try:
            decoded = pybase64.b64decode(data, validate=True)
        except ValueError:
            raise ValueError("video: not valid base64") from None
        return self.load_bytes(decoded)

    def load_file(self, filepath: Path) -> Any:
        return self.load_bytes(Path(filepath).read_bytes())


def _checked_io(media_io: Any, defer: bool = False) -> tuple[str, Any]:
    """``(modality, media IO)``: the IO vLLM built, wrapped when it loads images or videos (``defer``: an
    image to normalise is handed back, :class:`_Deferred`)."""
    from vllm.multimodal.media import ImageMediaIO, VideoMediaIO

    if isinstance(media_io, VideoMediaIO):
        return "video", _CheckedVideoIO(media_io)
    if isinstance(media_io, ImageMediaIO):
        return "image", _CheckedImageIO(media_io, "image", normalize=True, defer=defer)
    return type(media_io).__name__.removesuffix("MediaIO").lower() or "media", media_io


def _connector_class(base: type) -> type:
    # The threads vLLM's connector loads media on (None: the default executor, where a vLLM has none)
    loading = getattr(sys.modules[base.__module__], "global_thread_pool", None)

    class GuardedMediaConnector(base):
        """vLLM's media connector under vlguard's media policy (:mod:`server.vllm_hooks.media_connector`)."""

        def __init__(self, media_io_kwargs: dict[str, dict[str, Any]] | None = None, *args: Any, **kwargs: Any):
            _current().check_io_kwargs(media_io_kwargs)
            super().__init__(media_io_kwargs, *args, **kwargs)

        def load_from_url(self, url: str, media_io: Any, **kwargs: Any) -> Any:
            modality, checked = _checked_io(media_io)
            if _current().check_url(modality, url) in ("http", "https"):  # vLLM's front end loads async
                raise ValueError(f"{modality}: remote media is fetched on vLLM's asynchronous path only")
            return super().load_from_url(url, checked, **kwargs)

        async def load_from_url_async(self, url: str, media_io: Any, **kwargs: Any) -> Any:
            modality, checked = _checked_io(media_io, defer=True)
            loop = asyncio.get_running_loop()
            try:
                if _current().check_url(modality, url) in ("http", "https"):  # fetched by vlguard, never by vLLM
                    data = await _current().fetch(url)
                    return await loop.run_in_executor(loading, checked.load_bytes, data)
                return await super().load_from_url_async(url, checked, **kwargs)
            except _Deferred as deferred:  # normalised in the decode pool; no loading thread waits for it
                # Its traceback's frames make a cycle (the thread's work item and future hold it): dropped
                # now, the image's bytes go when it is loaded, not at the next full garbage collection.
                image = deferred.with_traceback(None)
            normalized = await _current().normalized_async("image", image.data, image.pixels)
            return await loop.run_in_executor(loading, checked.load_normalized, normalized)

    return GuardedMediaConnector


def _without_uuids(uuids: Any) -> Any:
    """``uuids`` (modality -> uuid or None per item) with every uuid None, unless client uuids are trusted."""
    if _trust_uuids[0] or not isinstance(uuids, dict):
        return uuids
    return {modality: None if items is None else [None] * len(items) for modality, items in uuids.items()}


def _forget_uuids(resolve: Any) -> Any:
    """``resolve_items`` of a tracker, answering no uuids (sync or async, as the original)."""
    if asyncio.iscoroutinefunction(resolve):

        async def resolve_async(self: Any) -> Any:
            data, uuids = await resolve(self)
            return data, _without_uuids(uuids)

        return resolve_async

    def resolve_sync(self: Any) -> Any:
        data, uuids = resolve(self)
        return data, _without_uuids(uuids)

    return resolve_sync


def install(policy: MediaPolicy, trust_client_uuids: bool = False) -> str:
    """Apply ``policy`` to every media item vLLM loads in this process (see the module docstring).

    Returns:
        the connector name the policy is registered under.
    Raises:
        ValueError: ``VLLM_MEDIA_CONNECTOR`` names a connector other than vLLM's own.
        ImportError: vLLM's media connector or item trackers not found (an unsupported vLLM version).
    """
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    name = os.environ.get(CONNECTOR_ENV, VLLM_CONNECTOR)
    registered = MEDIA_CONNECTOR_REGISTRY.name2class.get(name)
    if registered is None or not issubclass(registered, MediaConnector):
        raise ValueError(f"{CONNECTOR_ENV}={name!r}: vlguard applies its media policy to vLLM's own media "
                         f"connector ({VLLM_CONNECTOR!r}) only; unset it")  # fmt: skip
    if registered is MediaConnector:
        MEDIA_CONNECTOR_REGISTRY.register(name)(_connector_class(MediaConnector))
    elif registered.__name__ != "GuardedMediaConnector":
        raise ValueError(f"{CONNECTOR_ENV}={name!r} names a subclass of vLLM's connector; vlguard cannot apply its "
                         "media policy to it: unset it")  # fmt: skip
    _policy[:] = [policy]
    _trust_uuids[0] = trust_client_uuids
    wrap_item_trackers("resolve_items", _forget_uuids)
    return name
