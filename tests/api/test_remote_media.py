"""Remote image URLs with ``--guard-remote-media on``: vlguard fetches them under its policy (allow-listed
hosts, public addresses, checked redirects, bounded size and time). A local HTTP server on 127.0.0.1
(allow-listed by its literal address) plays the media host. In-process: the fetch and its policy are
vlguard's own, the inlined image then goes through vLLM's real processor."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from server.workload.images import photo_bytes, photo_uri
from tests.api.test_media_layer import tool_output_body
from tests.helpers import chat_body, http_host
from tests.inprocess import Api

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
    with http_host(_Media) as url:
        yield url
        _Media.stop.set()  # releases a request still sleeping in /slow.png


@pytest.fixture
async def remote(make_api: Callable[..., object]) -> Api:
    api = await make_api("--guard-remote-media", "on", "--allowed-media-domains", "127.0.0.1",  # type: ignore[misc]
                         "--guard-remote-media-timeout", str(TIMEOUT_S), "--guard-max-image-mb", "1")  # fmt: skip
    assert isinstance(api, Api)
    return api


async def _chat(api: Api, url: str) -> httpx.Response:
    return await api.client.post("/v1/chat/completions", json=chat_body(api.model, url, text="Describe it."))


async def test_an_allow_listed_image_is_fetched_and_served(remote: Api, media_host: str) -> None:
    assert (await _chat(remote, media_host + "/ok.png")).status_code == 200
    fetched = remote.engine.inputs[remote.engine.requests[-1]]["mm_hashes"]
    assert (await _chat(remote, photo_uri("astronaut.png"))).status_code == 200
    assert remote.engine.inputs[remote.engine.requests[-1]]["mm_hashes"] == fetched  # the same image, inlined
    assert (await _chat(remote, media_host + "/redirect-ok")).status_code == 200


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
async def test_bad_remote_media_is_a_bounded_4xx_or_504(
    remote: Api, media_host: str, path: str, status: int, words: str
) -> None:
    started = time.monotonic()
    resp = await _chat(remote, media_host + path)
    assert resp.status_code == status and words in resp.json()["error"]["message"], resp.text
    assert time.monotonic() - started < TIMEOUT_S + 5
    assert (await _chat(remote, photo_uri("astronaut.png"))).status_code == 200


async def test_hosts_outside_the_allow_list_are_refused(remote: Api, media_host: str) -> None:
    port = media_host.rsplit(":", 1)[1]
    resp = await _chat(remote, f"http://localhost:{port}/ok.png")
    assert resp.status_code == 400 and "not in --allowed-media-domains" in resp.json()["error"]["message"]


def _tool_output(api: Api, url: str) -> dict[str, object]:
    """A Responses request whose image sits in a tool output: loaded by vLLM's media connector, not the door."""
    return tool_output_body(api.model, {"type": "input_image", "image_url": url, "detail": "auto"})


def _anthropic(api: Api, url: str) -> dict[str, object]:
    image = {"type": "image", "source": {"type": "url", "url": url}}
    return {"model": api.model, "max_tokens": 2, "messages": [{"role": "user", "content": [image]}]}


@pytest.mark.parametrize(
    ("path", "shape"), [("/v1/responses", _tool_output), ("/v1/messages", _anthropic)], ids=["tool-output", "anthropic"]
)
async def test_shapes_the_door_does_not_read_are_fetched_under_the_same_policy(
    remote: Api, media_host: str, path: str, shape: Callable[[Api, str], dict[str, object]]
) -> None:
    """Hostile review of #44: vLLM's own fetch followed a redirect from an allow-listed host to any address
    (``localhost``, a metadata address) and read a 200 MB body whole before the size check. In vLLM's media
    connector the fetch is vlguard's: each hop checked, the size bounded while it arrives."""
    for url, words in (
        ("/to-localhost", "'localhost' is not in --allowed-media-domains"),
        ("/to-private", "not in --allowed-media-domains"),
        ("/big.png", "larger than 1048576 bytes"),
        ("/loop", "redirects"),
    ):
        resp = await remote.client.post(path, json=shape(remote, media_host + url))
        assert 400 <= resp.status_code < 500, (url, resp.status_code, resp.text[:300])
        assert words in resp.text, (url, resp.text[:300])
    ok = await remote.client.post(path, json=shape(remote, media_host + "/redirect-ok"))
    assert ok.status_code < 500 and "fetching" not in ok.text, ok.text[:300]
