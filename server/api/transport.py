"""Checks at the ASGI transport, in front of every route (API process): what a request's headers must be
before anything reads them.

A header that may appear once but arrives several times is read differently by different readers: vLLM's
API-key middleware takes the first ``Authorization``, a dict of the headers takes the last. A client
refused by the per-client fault budget could otherwise present a second ``Authorization`` and be counted
as someone else while vLLM still authenticates the first. Every request that repeats one of
:data:`SINGLE_HEADERS` is refused with 400 before any route, middleware or body read sees it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.errors import error_response

#: Headers a request may carry at most once: credentials and identity (who the client is), and what tells
#: the door how to read the body.
SINGLE_HEADERS = frozenset({b"authorization", b"x-request-id", b"content-type"})


def repeated_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first of :data:`SINGLE_HEADERS` that ``headers`` (an ASGI scope's, names lower-case) repeats."""
    seen: set[bytes] = set()
    for name, _ in headers:
        if name in SINGLE_HEADERS:
            if name in seen:
                return name.decode("latin-1")
            seen.add(name)
    return None


class SingleHeadersMiddleware:
    """Refuse, with 400 in the OpenAI error envelope, an HTTP request that repeats a header of
    :data:`SINGLE_HEADERS` (pure ASGI: the body is never read)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (name := repeated_header(scope.get("headers") or [])) is not None:
            response = error_response(400, f"the {name} header may appear only once", param=name)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
