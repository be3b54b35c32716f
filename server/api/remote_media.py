"""Fetch a request's remote media safely and inline it as ``data:`` URIs, so vLLM never fetches.

Used only with ``--guard-remote-media on``. For every ``http(s)`` media URL of a request:

* the host must be in the allow-list (vLLM's ``--allowed-media-domains``; without one, every host is
  refused), and every address it resolves to must be public, unless the allow-list names that address
  literally (an operator's internal media server);
* redirects are followed by hand, at most :data:`MAX_REDIRECTS`, each hop checked the same way;
* the whole fetch is bounded in time (``--guard-remote-media-timeout``, then **504**) and in size
  (``--guard-max-image-mb``, then **413**);
* a non-2xx answer, a connection failure or a body that is not a readable image is **400**.

Known limit: the address check and httpx's own connection resolve the name separately (a DNS-rebinding
window); allow-list names you control.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from server.api.media import MediaError, MediaLimits, checked_image_uri, media_parts

MAX_REDIRECTS = 3


@dataclass(frozen=True)
class RemotePolicy:
    """Which hosts may be fetched, and for how long (seconds, the whole fetch with redirects)."""

    allowed_hosts: frozenset[str]
    timeout_s: float


def address_allowed(host: str, address: str, policy: RemotePolicy) -> bool:
    """Whether ``address`` (one resolution of ``host``) may be connected to: public, or named literally
    in the allow-list."""
    ip = ipaddress.ip_address(address)
    return ip.is_global or address in policy.allowed_hosts


async def _check_host(where: str, url: str, policy: RemotePolicy) -> None:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: not an http(s) URL: {url[:80]!r}")
    if host not in policy.allowed_hosts:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: host {host!r} is not in --allowed-media-domains")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: cannot resolve {host!r} ({exc})") from None
    refused = [str(info[4][0]) for info in infos if not address_allowed(host, str(info[4][0]), policy)]
    if refused:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: {host!r} resolves to a non-public address {refused[0]}")


async def _download(where: str, url: str, client: httpx.AsyncClient, policy: RemotePolicy, max_bytes: int) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        await _check_host(where, url, policy)
        async with client.stream("GET", url) as resp:
            if resp.is_redirect:
                url = urljoin(url, resp.headers.get("location", ""))
                continue
            if resp.status_code != HTTPStatus.OK:
                raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: fetching the media failed: HTTP {resp.status_code}")
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise MediaError(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"{where}: remote media larger than {max_bytes} bytes"
                    )
            return bytes(data)
    raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: more than {MAX_REDIRECTS} redirects")


async def fetch_media(where: str, url: str, limits: MediaLimits, policy: RemotePolicy) -> str:
    """Fetch one media URL under ``policy`` and return it as a ``data:`` URI (normalised as data: images are).

    Raises:
        MediaError: 400 (policy, HTTP error, connection failure, unreadable image), 413 (too large),
            504 (slower than ``policy.timeout_s``).
    """
    try:
        async with asyncio.timeout(policy.timeout_s):
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
                data = await _download(where, url, client, policy, limits.max_image_bytes)
    except TimeoutError:
        raise MediaError(
            HTTPStatus.GATEWAY_TIMEOUT, f"{where}: fetching the media took longer than {policy.timeout_s:g} s"
        ) from None
    except httpx.HTTPError as exc:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: fetching the media failed ({exc!r})") from None
    uri, _ = await asyncio.to_thread(checked_image_uri, where, data, limits)  # decoding: off the event loop
    return uri


async def inline_remote_media(body: dict[str, Any], limits: MediaLimits, policy: RemotePolicy) -> int:
    """Replace every ``http(s)`` image URL in ``body`` (in place) by the fetched image as a data URI.
    Fetches run concurrently. Returns how many were fetched.

    Raises:
        MediaError: from :func:`fetch_media`, for the first URL that failed.
    """
    targets = [p for p in media_parts(body) if p.is_image and p.url.lower().startswith(("http://", "https://"))]
    uris = await asyncio.gather(*(fetch_media(p.where, p.url, limits, policy) for p in targets))
    for part, uri in zip(targets, uris, strict=True):
        part.replace(uri)
    return len(targets)
