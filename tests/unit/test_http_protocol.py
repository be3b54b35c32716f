"""The header timeout (:mod:`server.http_protocol`) on a real uvicorn server on loopback: a connection
whose request headers do not arrive in time is closed; complete requests and idle keep-alive connections
are not touched by it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from server.http_protocol import http_protocol

TIMEOUT_S = 1.0


async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


@pytest.fixture
def port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, http=http_protocol(TIMEOUT_S), timeout_keep_alive=30, log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def closed_within(conn: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``conn`` (None: still open after ``seconds``)."""
    conn.settimeout(seconds)
    started = time.monotonic()
    try:
        while conn.recv(4096):
            pass
    except TimeoutError:
        return None
    return time.monotonic() - started


def request(conn: socket.socket) -> bytes:
    """One whole request and its whole answer on ``conn`` (the app answers ``ok``)."""
    conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn.settimeout(10)
    answer = b""
    while not answer.endswith(b"\r\n\r\nok"):
        answer += conn.recv(4096)
    return answer


def test_partial_headers_are_closed_after_the_timeout(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        took = closed_within(conn, TIMEOUT_S * 5)
    assert took is not None and took < TIMEOUT_S * 3


def test_a_silent_new_connection_is_closed_after_the_timeout(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        assert closed_within(conn, TIMEOUT_S * 5) is not None


def test_complete_requests_and_idle_keep_alive_are_untouched(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(2):
            assert request(conn).startswith(b"HTTP/1.1 200")
        assert closed_within(conn, TIMEOUT_S * 3) is None  # idle after a response: keep-alive's, 30 s
        assert request(conn).startswith(b"HTTP/1.1 200")
        conn.sendall(b"GET / HTTP/1.1\r\n")  # the next request's headers stall
        assert closed_within(conn, TIMEOUT_S * 5) is not None
