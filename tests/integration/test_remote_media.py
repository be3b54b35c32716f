"""Remote image URLs with ``--guard-remote-media on``: vlguard fetches them under its policy (allow-listed
hosts, public addresses, checked redirects, bounded size and time). A local HTTP server on 127.0.0.1
(allow-listed by its literal address) plays the media host."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.workload.images import photo_bytes, photo_uri
from tests.servers import ServerProcess, engine_env, vlguard_argv

PNG = photo_bytes("astronaut.png")
TIMEOUT_S = 3


class _Media(http.server.BaseHTTPRequestHandler):
    stop = threading.Event()

    def log_message(self, *args: object) -> None:  # keep the test output clean
        pass

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        routes = {
            "/ok.png": (200, "image/png", PNG, None),
            "/missing.png": (404, "text/plain", b"no", None),
            "/text.png": (200, "text/plain", b"hello, not an image", None),
            "/big.png": (200, "image/png", b"\x89PNG" + b"\0" * (2 * 1024 * 1024), None),
            "/redirect-ok": (302, "text/plain", b"", "/ok.png"),
            "/to-localhost": (302, "text/plain", b"", f"http://localhost:{port}/ok.png"),
            "/to-private": (302, "text/plain", b"", "http://10.255.255.1/ok.png"),
            "/loop": (302, "text/plain", b"", "/loop"),
        }
        if self.path == "/slow.png":
            self.stop.wait(TIMEOUT_S * 3)  # slower than the fetch timeout (released at teardown)
            routes[self.path] = (200, "image/png", PNG, None)
        status, ctype, body, location = routes.get(self.path, (404, "text/plain", b"", None))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if location:
            self.send_header("Location", location)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def media_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _Media.stop.set()
    server.shutdown()


@pytest.fixture(scope="module")
def remote(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    argv = vlguard_argv(tiny_model, "--enforce-eager", "--guard-remote-media", "on",
                        "--allowed-media-domains", "127.0.0.1", "--guard-remote-media-timeout", str(TIMEOUT_S),
                        "--guard-max-image-mb", "1")  # fmt: skip
    srv = ServerProcess(argv, tmp_path_factory.mktemp("logs") / "remote.log", env=engine_env())
    srv.start().wait_ready()
    yield srv
    srv.stop()


def _chat(srv: ServerProcess, model: str, url: str) -> httpx.Response:
    content = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)


def test_an_allow_listed_image_is_fetched_and_served(remote: ServerProcess, model_name: str, media_host: str) -> None:
    assert _chat(remote, model_name, media_host + "/ok.png").status_code == 200
    assert _chat(remote, model_name, media_host + "/redirect-ok").status_code == 200


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/missing.png", 400, "HTTP 404"),
        ("/text.png", 400, "not a readable image"),
        ("/big.png", 413, "larger than"),
        ("/to-localhost", 400, "not in --allowed-media-domains"),
        ("/to-private", 400, "not in --allowed-media-domains"),
        ("/loop", 400, "redirects"),
        ("/slow.png", 504, "longer than"),
    ],
)
def test_bad_remote_media_is_a_bounded_4xx_or_504(
    remote: ServerProcess, model_name: str, media_host: str, path: str, status: int, words: str
) -> None:
    started = time.monotonic()
    resp = _chat(remote, model_name, media_host + path)
    assert resp.status_code == status and words in resp.json()["error"]["message"], resp.text
    assert time.monotonic() - started < TIMEOUT_S + 5
    assert _chat(remote, model_name, photo_uri("astronaut.png")).status_code == 200


def test_hosts_outside_the_allow_list_are_refused(remote: ServerProcess, model_name: str, media_host: str) -> None:
    port = media_host.rsplit(":", 1)[1]
    resp = _chat(remote, model_name, f"http://localhost:{port}/ok.png")
    assert resp.status_code == 400 and "not in --allowed-media-domains" in resp.json()["error"]["message"]
