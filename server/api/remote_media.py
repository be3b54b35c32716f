"""Fetch a request's remote media safely and inline it as ``data:`` URIs, so vLLM never fetches.

Used only with ``--guard-remote-media on``. For every ``http(s)`` media URL of a request:

* the host must be in the allow-list (vLLM's ``--allowed-media-domains``; without one, every host is
  refused), and every address it resolves to must be public, unless the allow-list names that address
  literally (an operator's internal media server);
* redirects are followed by hand, at most :data:`MAX_REDIRECTS`, each hop checked the same way;
* the whole fetch is bounded in time (``--guard-remote-media-timeout``, then **504**) and in size
  (``--guard-max-image-mb``, then **413**);
* a non-2xx answer, a connection failure, a malformed URL or a body that is not a readable image is
  **400** with a message that names the kind of failure, not its details (no traceback in the log);
* a request's fetches run together, at most as many as the per-prompt image limit (counted first), and
  the first failure cancels the rest.

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

from server.api.media import MediaError, MediaLimits, MediaPart, check_image_bytes, data_uri, media_parts

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


def _split(where: str, url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``url``.

    Raises:
        MediaError: 400 for a URL that is not http(s) with a host, or that cannot be parsed (a bad IPv6
            literal, a port out of range): a client's typo is its own 400, never a traceback.
    """
    try:
        parts = urlsplit(url)
        scheme, host = parts.scheme, (parts.hostname or "").lower()
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: malformed URL") from None
    if scheme not in ("http", "https") or not host:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: not an http(s) URL")
    return scheme, host, port


async def _check_host(where: str, url: str, policy: RemotePolicy) -> None:
    _, host, port = _split(where, url)
    if host not in policy.allowed_hosts:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: host {host!r} is not in --allowed-media-domains")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: cannot resolve {host!r}") from None
    refused = [str(info[4][0]) for info in infos if not address_allowed(host, str(info[4][0]), policy)]
    if refused:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: {host!r} resolves to a non-public address")


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


async def fetch_bytes(where: str, url: str, max_bytes: int, policy: RemotePolicy) -> bytes:
    """Fetch ``url`` under ``policy``: every hop's host allow-listed and its addresses public, redirects
    followed by hand, at most ``max_bytes`` read, the whole fetch within ``policy.timeout_s``.

    Raises:
        MediaError: 400 (policy, HTTP error, connection failure: the message names the failure's kind, not
            its details), 413 (too large), 504 (slower than ``policy.timeout_s``).
    """
    try:
        async with asyncio.timeout(policy.timeout_s):
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
                return await _download(where, url, client, policy, max_bytes)
    except TimeoutError:
        raise MediaError(
            HTTPStatus.GATEWAY_TIMEOUT, f"{where}: fetching the media took longer than {policy.timeout_s:g} s"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
        raise MediaError(HTTPStatus.BAD_REQUEST, f"{where}: fetching the media failed ({type(exc).__name__})") from None


async def fetch_image(part: MediaPart, limits: MediaLimits, policy: RemotePolicy) -> None:
    """Fetch one image URL under ``policy`` (:func:`fetch_bytes`), read its header for its type and put it
    in ``part`` as a ``data:`` URI (its checksums and pixels are checked, and it is normalised, where vLLM
    loads it: :class:`server.api.media_policy.MediaPolicy`).

    Raises:
        MediaError: as :func:`fetch_bytes`, and 400 for an unreadable image.
    """
    where = part.where
    data = await fetch_bytes(where, part.url, limits.max_image_bytes, policy)
    header = check_image_bytes(where, data, limits, checksums=False)  # the header only: microseconds
    part.replace(data_uri(header.mime, data))


async def inline_remote_media(body: dict[str, Any], limits: MediaLimits, policy: RemotePolicy) -> int:
    """Replace every ``http(s)`` image URL in ``body`` (in place) by the fetched image as a ``data:`` URI.
    Fetches run concurrently (as many as the request has images: the door counted them against the
    per-prompt limit first); the first failure cancels the others.

    Returns:
        how many images were fetched.

    Raises:
        MediaError: from :func:`fetch_image`, for the first URL that failed.
    """
    targets = [p for p in media_parts(body) if p.is_image and p.url.lower().startswith(("http://", "https://"))]
    if not targets:
        return 0
    try:
        async with asyncio.TaskGroup() as group:
            for p in targets:
                group.create_task(fetch_image(p, limits, policy))
    except BaseExceptionGroup as failed:
        first = failed.exceptions[0]
        raise first.with_traceback(None) from None
    return len(targets)
