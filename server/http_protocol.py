"""uvicorn's HTTP protocol with a bound on the time a request's headers may take to arrive.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection that sends part
of a request's headers and then trickles or stops (slowloris) is held open for ever: a client could hold
every file descriptor of the API process with such connections, below the ASGI layer where the transport
checks (:mod:`server.api.transport`) cannot see them. This protocol starts a clock when a connection opens
and when the first bytes of each next request arrive; the connection is closed if no request has started
(its headers complete) when ``header_timeout_s`` has passed. Idle keep-alive connections are left to
uvicorn's own timeout.

It also bounds a request's head (request line and headers) in bytes: uvicorn's httptools parser takes any
number of headers, each through a Python callback on the event loop (a 98 MB header block was parsed into
a 200, holding the loop 1.2 s and leaving the process 600 MB larger); h11 bounds it only at vLLM's 4 MiB.
A head still unfinished past ``max_head_bytes`` is answered 431 and the connection closed; the parser has
then seen at most that and one read more.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

#: Bytes a request's line and headers may take by default (``--guard-max-header-kb``)
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
#: Seconds a connection whose head was refused is read (and dropped) before it is closed
LINGER_S = 2.0


def with_header_timeout(
    base: type[asyncio.Protocol], header_timeout_s: float, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
) -> type[asyncio.Protocol]:
    """``base`` (one of uvicorn's HTTP protocol classes) closing connections whose request headers take
    longer than ``header_timeout_s`` seconds, and answering 431 (then closing) a request whose request line
    and headers run past ``max_head_bytes`` bytes before they end."""

    class HeaderTimeoutProtocol(base):  # type: ignore[valid-type, misc]
        _header_clock: asyncio.TimerHandle | None = None
        _waiting_for: Any = None  # the cycle a new request's headers replace
        _head_bytes = 0  # bytes of the request's head received so far
        _refused = False  # a head past the bound was answered 431: what follows is dropped

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._start_header_clock()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the rest of a refused head, read and dropped until the connection closes
            if self._header_clock is None and self._between_requests():
                self._start_header_clock()
            super().data_received(data)
            if self._header_clock is not None and getattr(self, "cycle", None) is self._waiting_for:
                self._head_bytes += len(data)  # the head has not ended: every byte so far was head
                if self._head_bytes > max_head_bytes:
                    self._refuse_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._stop_header_clock()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_clock()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or bool(getattr(cycle, "response_complete", False))

        def _start_header_clock(self) -> None:
            waiting_for = getattr(self, "cycle", None)  # a new request replaces it once its headers are in
            self._waiting_for, self._head_bytes = waiting_for, 0
            self._header_clock = self.loop.call_later(header_timeout_s, self._headers_late, waiting_for)

        def _refuse_head(self) -> None:
            self._stop_header_clock()
            transport = getattr(self, "transport", None)
            if transport is None or transport.is_closing():
                return
            message = f"request line and headers longer than this server's limit of {max_head_bytes} bytes"
            transport.write(_raw_response(431, message))
            # A lingering close: the client may still be sending; closing with its bytes unread would reset
            # the connection and could lose the answer. Read and drop for a moment, then close.
            self._refused = True
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)

        def _stop_header_clock(self) -> None:
            if self._header_clock is not None:
                self._header_clock.cancel()
                self._header_clock = None

        def _headers_late(self, waiting_for: Any) -> None:
            self._header_clock = None
            transport = getattr(self, "transport", None)
            if getattr(self, "cycle", None) is waiting_for and transport is not None and not transport.is_closing():
                transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


def _raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error response in the OpenAI envelope, closing the connection (written below ASGI)."""
    from server.api.errors import error_response

    response = error_response(status, message)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(response.body)}", "connection: close"]  # fmt: skip
    return ("\r\n".join(head) + "\r\n\r\n").encode() + bytes(response.body)


def http_protocol(header_timeout_s: float, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES) -> type[asyncio.Protocol]:
    """uvicorn's ``auto`` HTTP protocol (httptools when installed, else h11) with the header timeout and
    the bound on a request's head."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return with_header_timeout(base, header_timeout_s, max_head_bytes)
