"""uvicorn's HTTP protocol with a bound on the time a request's headers may take to arrive.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection that sends part
of a request's headers and then trickles or stops (slowloris) is held open for ever: a client could hold
every file descriptor of the API process with such connections, below the ASGI layer where the transport
checks (:mod:`server.api.transport`) cannot see them. This protocol starts a clock when a connection opens
and when the first bytes of each next request arrive; the connection is closed if no request has started
(its headers complete) when ``header_timeout_s`` has passed. Idle keep-alive connections are left to
uvicorn's own timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any


def with_header_timeout(base: type[asyncio.Protocol], header_timeout_s: float) -> type[asyncio.Protocol]:
    """``base`` (one of uvicorn's HTTP protocol classes) closing connections whose request headers take
    longer than ``header_timeout_s`` seconds."""

    class HeaderTimeoutProtocol(base):  # type: ignore[valid-type, misc]
        _header_clock: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._start_header_clock()

        def data_received(self, data: bytes) -> None:
            if self._header_clock is None and self._between_requests():
                self._start_header_clock()
            super().data_received(data)

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
            self._header_clock = self.loop.call_later(header_timeout_s, self._headers_late, waiting_for)

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


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's ``auto`` HTTP protocol (httptools when installed, else h11) with the header timeout."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return with_header_timeout(base, header_timeout_s)
