"""#34 through a real server's sockets: uploads that send a POST's headers and never the body hold none of
vlguard's in-flight slots: real requests are served and /ready stays truthful (the 408 once
``--guard-body-timeout`` has passed is tested in-process, tests/api/test_door_load.py)."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack
from urllib.parse import urlsplit

import httpx

from tests.servers import ServerProcess

STALLED = 1030  # more than the default --guard-max-inflight (1024)


def test_stalled_uploads_do_not_lock_the_server(server: ServerProcess, model_name: str) -> None:
    """Before: 1030 such connections held all 1024 slots indefinitely; every real request got 429 while
    /ready stayed 200 (stock vLLM answered in 0.09 s under the same load)."""
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    assert host is not None and port is not None
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{\"model\": ").encode()  # fmt: skip
    with ExitStack() as stack:
        for _ in range(STALLED):
            sock = stack.enter_context(socket.create_connection((host, port), timeout=30))
            sock.sendall(head)
        started = time.monotonic()
        body = {"model": model_name, "messages": [{"role": "user", "content": "Is the exit clear?"}], "max_tokens": 2}
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < 30
        assert httpx.get(server.url + "/ready").status_code == 200
