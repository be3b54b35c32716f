"""uvicorn's HTTP protocol with a bound on the time a request's headers may take to arrive.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection that sends part
of a request's headers and then trickles or stops (slowloris) is held open for ever: a client could hold
every file descriptor of the API process with such connections, below the ASGI layer where the transport
checks (:mod:`server.api.transport`) cannot see them. This protocol starts a clock when a connection opens
and when the first bytes of each next request arrive; the connection is closed if no request has started
(its headers complete) when ``header_timeout_s`` has passed. Idle keep-alive connections are left to
uvicorn's own timeout.

A client's IPv4-mapped address (an IPv4 client of a dual-stack listener) is written in its IPv4 form before
anything reads it (:func:`ipv4_form`).

It also bounds a request's head (request line and headers) in bytes: uvicorn's httptools parser takes any
number of headers, each through a Python callback on the event loop (a 98 MB header block was parsed into
a 200, holding the loop 1.2 s and leaving the process 600 MB larger); h11 bounds it only at vLLM's 4 MiB.
A head still unfinished past ``max_head_bytes`` is answered 431 and the connection closed; the parser has
then seen at most that and one read more.
"""

from __future__ import annotations

import asyncio
import ipaddress
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    _ProtocolBase = Any  # uvicorn's protocol class, mixed in after it
else:
    _ProtocolBase = object

#: Bytes a request's line and headers may take by default (``--guard-max-header-kb``)
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
#: Seconds a connection whose head was refused is read (and dropped) before it is closed
LINGER_S = 2.0


class HeadTooLargeError(Exception):
    """A request's line and headers ran past the bound (raised inside httptools' callbacks)."""


class _HeadGuard(_ProtocolBase):
    """The header timeout and the head bound, over one of uvicorn's HTTP protocol classes (mixed in first by
    :func:`with_header_timeout`, which sets the three class attributes).

    httptools hands each request's URL and headers to Python callbacks: they are counted there, exactly,
    whenever the head arrives (a head pipelined behind a slow response too); a header hands over only once
    it ends, so the raw bytes of every read that left the head unfinished are counted too (a value or a
    name that never ends), and after the head those of the reads that carried no body (a chunked trailer that
    never ends). h11 parses a head only between responses (it stops reading meanwhile): bytes are
    counted while the head is awaited."""

    header_timeout_s: float
    max_head_bytes: int
    by_callbacks: bool
    _header_clock: asyncio.TimerHandle | None = None
    _waiting_for: Any = None  # the cycle a new request's headers replace
    _head_bytes = 0  # bytes of the request's head received so far
    _in_head = False  # httptools: a request's head began and has not ended
    _raw_head = 0  # httptools: bytes of the reads that left the head unfinished
    _in_message = False  # httptools: a request began and has not ended
    _moved = False  # httptools: this read carried body bytes or ended the request
    _raw_tail = 0  # httptools: bytes of the reads after the head that carried no body (chunked trailers)
    _over = False  # the head ran past the bound (httptools: the parser stopped on it)
    _refused = False  # a head past the bound was answered 431: what follows is dropped

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        client = getattr(self, "client", None)  # an IPv4 client of a dual-stack listener: ::ffff:a.b.c.d
        if client:
            self.client = (ipv4_form(client[0]), *client[1:])
        self._start_header_clock()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused head, read and dropped until the connection closes
        if self._header_clock is None and self._between_requests():
            self._start_header_clock()
        self._moved = False
        super().data_received(data)
        if self.by_callbacks:
            if self._in_head and not self._refused:  # the parse left the head unfinished: this read was head
                self._raw_head += len(data)
                if self._raw_head > self.max_head_bytes:
                    self._refuse_head()
            elif self._in_message and not self._moved:  # after the head, no body: a chunked trailer's bytes
                self._raw_tail += len(data)
                if self._raw_tail > self.max_head_bytes:
                    self._refuse_tail()
            return
        if self._header_clock is None or getattr(self, "cycle", None) is not self._waiting_for:
            return
        self._head_bytes += len(data)  # the head has not ended: every byte so far was head
        if self._head_bytes > self.max_head_bytes:
            self._refuse_head()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self._head_bytes = self._raw_head = self._raw_tail = 0
        self._in_head = self._in_message = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._moved = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._moved, self._in_message = True, False
        super().on_message_complete()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            self._over = True
            raise HeadTooLargeError  # stops the parser: uvicorn answers its parser errors below

    def send_400_response(self, msg: str) -> None:
        if self._over:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._stop_header_clock()
        if self._refused:  # a head refused behind this response: its 431 follows it, in order
            self._answer_431()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_clock()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is None or bool(getattr(cycle, "response_complete", False))

    def _start_header_clock(self) -> None:
        waiting_for = getattr(self, "cycle", None)  # a new request replaces it once its headers are in
        self._waiting_for, self._head_bytes = waiting_for, 0
        self._header_clock = self.loop.call_later(self.header_timeout_s, self._headers_late, waiting_for)

    def _refuse_head(self) -> None:
        """431 for the head past the bound; what the client sends after it is dropped. A response still
        being sent on the connection (the head was pipelined behind it) goes first."""
        self._stop_header_clock()
        self._refused = True
        if self._between_requests():
            self._answer_431()

    def _refuse_tail(self) -> None:
        """A request whose trailer (after a chunked body) runs past the head bound: what follows is dropped
        and the connection closed (its route is reading a body that will not end: it sees a disconnect)."""
        self._refused = True
        transport = getattr(self, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.close()

    def _answer_431(self) -> None:
        transport = getattr(self, "transport", None)
        if transport is None or transport.is_closing():
            return
        message = f"request line and headers longer than this server's limit of {self.max_head_bytes} bytes"
        transport.write(_raw_response(431, message))
        # A lingering close: the client may still be sending; closing with its bytes unread would reset
        # the connection and could lose the answer. Read and drop for a moment, then close.
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


def ipv4_form(host: str) -> str:
    """``host`` as its IPv4 form when it is an IPv4-mapped IPv6 address (``::ffff:127.0.0.1`` ->
    ``127.0.0.1``), else unchanged: the trusted-proxy list, the loopback rules and the client identities
    then see one address, whichever socket family accepted it."""
    if not host.startswith("::ffff:") and not host.startswith("::FFFF:"):
        return host
    try:
        mapped = ipaddress.IPv6Address(host).ipv4_mapped
    except ValueError:
        return host
    return str(mapped) if mapped is not None else host


def with_header_timeout(
    base: type[asyncio.Protocol], header_timeout_s: float, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
) -> type[asyncio.Protocol]:
    """``base`` (one of uvicorn's HTTP protocol classes) closing connections whose request headers take
    longer than ``header_timeout_s`` seconds, and answering 431 (then closing) a request whose request line
    and headers run past ``max_head_bytes`` bytes before they end."""
    attributes = {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes,
                  "by_callbacks": hasattr(base, "on_header")}  # fmt: skip
    return type(f"HeaderTimeout{base.__name__}", (_HeadGuard, base), attributes)


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
