"""Checks at the ASGI transport, in front of every route (API process): what a request's headers must be
before anything reads them or its body.

- A header that may appear once but arrives several times is read differently by different readers:
  vLLM's API-key middleware takes the first ``Authorization``, a dict of the headers takes the last. A
  client refused by the per-client fault budget could otherwise present a second ``Authorization`` and be
  counted as someone else while vLLM still authenticates the first. Every request that repeats one of
  :data:`SINGLE_HEADERS` is refused with 400.
- With API keys (``--api-key``), a request that carries a body (POST, PUT, PATCH) needs a valid key on
  every route, not only under ``/v1`` as vLLM's middleware asks (``/tokenize``, ``/detokenize``, the
  render routes and anything a later vLLM adds took input without a key): refused with 401 before its
  body is read, so an anonymous client holds none of the body budget; and, as vLLM's middleware asks, any
  other request under ``/v1`` but a CORS preflight, refused here in the OpenAI envelope (vLLM's says
  ``{"error": "Unauthorized"}``). The operator routes keep their own key (:mod:`server.api.admin`).
- ``HEAD`` is served wherever ``GET`` is, as ``GET`` without the body (vLLM's and vlguard's routes answered
  405: some probes and uptime checkers send ``HEAD``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.admission import route_path
from server.api.errors import error_response

#: Headers a request may carry at most once: credentials and identity (who the client is), and what tells
#: the door how to read the body.
SINGLE_HEADERS = frozenset({b"authorization", b"x-request-id", b"content-type", b"x-request-timeout"})


def repeated_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first of :data:`SINGLE_HEADERS` that ``headers`` (an ASGI scope's, names lower-case) repeats."""
    seen: set[bytes] = set()
    for name, _ in headers:
        if name in SINGLE_HEADERS:
            if name in seen:
                return name.decode("latin-1")
            seen.add(name)
    return None


def bearer_matches(header: str, keys: Sequence[str]) -> bool:
    """Whether an ``Authorization`` header value holds one of ``keys`` the way vLLM's ``/v1`` middleware
    reads it: scheme ``bearer`` in any case, then the token after the first space, compared in constant
    time (of the tokens' hashes)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = hashlib.sha256(token.encode()).digest()
    return any(hmac.compare_digest(given, hashlib.sha256(key.encode()).digest()) for key in keys)


#: Methods whose requests carry a body: with API keys, they need one before the body is read.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _needs_key(method: str, path: str) -> bool:
    """Whether a request needs the API key here: one with a body anywhere, and any other under ``/v1`` but a
    CORS preflight (as vLLM's own middleware asks, answered here in the envelope); the operator routes keep
    their own key."""
    if path.startswith("/admin/"):
        return False
    return method in BODY_METHODS or (method != "OPTIONS" and path.startswith("/v1"))


def _without_body(send: Send) -> Send:
    """``send`` for a HEAD request served as GET: the start (its headers, ``content-length`` included) as
    GET's, then one empty body."""

    async def head_send(message: Message) -> None:
        if message["type"] != "http.response.body":
            await send(message)
        elif not message.get("more_body", False):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return head_send


class TransportMiddleware:
    """Refuse, in the OpenAI error envelope and without reading the body (pure ASGI): an HTTP request that
    repeats a header of :data:`SINGLE_HEADERS` (400); with ``keys``, one without a valid key that needs it
    (:func:`_needs_key`: 401).

    Arguments:
        keys: the API keys the server requires; empty: none.
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str] = ()) -> None:
        self.app = app
        self.keys = list(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "HEAD":  # answered wherever GET is, without the body (probes, uptime checks)
                scope, send = {**scope, "method": "GET"}, _without_body(send)
            headers = scope.get("headers") or []
            if (name := repeated_header(headers)) is not None:
                await error_response(400, f"the {name} header may appear only once", param=name)(scope, receive, send)
                return
            if self.keys and _needs_key(scope["method"], route_path(scope)):
                auth = next((v for k, v in headers if k == b"authorization"), b"").decode("latin-1")
                if not bearer_matches(auth, self.keys):
                    response = error_response(401, "missing or invalid API key", param="authorization",
                                              headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
