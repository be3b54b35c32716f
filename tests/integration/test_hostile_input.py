"""Hostile input against a real server (CASES C8-C10 and the input guard): every bad request gets a clear
4xx in the OpenAI envelope, the next valid request succeeds, and the engine never dies or restarts.

One server for the module, with an API key and small limits so each limit is reachable cheaply.
"""

from __future__ import annotations

import base64
import io
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from server.workload.images import data_uri, photo_bytes, photo_uri
from tests.servers import ServerProcess, engine_env, metric_samples, vlguard_argv

KEY = "test-key-0f3a9c1e"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    argv = vlguard_argv(tiny_model, "--enforce-eager", "--api-key", KEY, "--guard-max-inflight", "3",
                        "--guard-max-request-mb", "8", "--guard-max-image-pixels", "4000000")  # fmt: skip
    srv = ServerProcess(argv, tmp_path_factory.mktemp("logs") / "hostile.log", env=engine_env())
    srv.start().wait_ready()
    yield srv
    srv.stop()


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, "PNG")
    return buf.getvalue()


def _corrupt_png() -> bytes:
    png = bytearray(_png(64, 64))
    idat = png.index(b"IDAT")
    png[idat + 8 : idat + 24] = b"\xff" * 16  # garbage inside the compressed pixel data
    return bytes(png)


def _chat(srv: ServerProcess, model: str, *urls: str, headers: dict[str, str] | None = None) -> httpx.Response:
    content = [{"type": "text", "text": "Is anyone wearing a helmet?"}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=HEADERS if headers is None else headers,
                      timeout=120)  # fmt: skip


def _engine_generation(srv: ServerProcess) -> tuple[str, float]:
    """The engine state and the total of engine deaths: both must not change across a bad request."""
    deaths = metric_samples(srv.url, "vlguard_engine_deaths").get("vlguard_engine_deaths_total", 0.0)
    return httpx.get(srv.url + "/health").json()["engine"], deaths


JPEG = photo_bytes("rocket.jpg")
BAD_MEDIA: dict[str, tuple[Callable[[], str], int, str]] = {
    # CASES C8
    "truncated-jpeg": (lambda: data_uri(JPEG[: len(JPEG) // 3], "image/jpeg"), 400, "truncated"),
    "random-bytes-as-png": (lambda: data_uri(bytes(range(256)) * 64, "image/png"), 400, "not a readable image"),
    "invalid-base64": (lambda: "data:image/png;base64,@@not*base64@@", 400, "invalid base64"),
    "empty-data-uri": (lambda: "data:image/png;base64,", 400, "empty data URI"),
    "corrupt-png-chunk": (lambda: data_uri(_corrupt_png(), "image/png"), 400, "image"),
    # limits and policy
    "decompression-bomb": (lambda: data_uri(_png(30000, 30000, "1"), "image/png"), 400, "pixels"),
    "extreme-aspect-ratio": (lambda: data_uri(_png(1000, 2), "image/png"), 400, "aspect ratio"),
    "remote-url-disabled": (lambda: "http://127.0.0.1:9/cat.png", 400, "remote media URLs are disabled"),
    "file-url": (lambda: "file:///etc/passwd", 400, "local file URLs are refused"),
    "unknown-scheme": (lambda: "ftp://example.invalid/cat.png", 400, "unsupported"),
    "not-base64-uri": (lambda: "data:image/png,rawbytes", 400, "malformed data URI"),
}


@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_gets_a_clear_4xx_and_nothing_is_lost(guarded: ServerProcess, model_name: str, case: str) -> None:
    make, status, words = BAD_MEDIA[case]
    before = _engine_generation(guarded)
    resp = _chat(guarded, model_name, make())
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and words.lower() in error["message"].lower(), error
    assert _chat(guarded, model_name, photo_uri("astronaut.png")).status_code == 200
    assert _engine_generation(guarded) == before == ("ready", 0.0)


def test_more_images_than_the_limit(guarded: ServerProcess, model_name: str) -> None:
    """CASES C9: the tiny profile allows 4 images per prompt."""
    resp = _chat(guarded, model_name, *[photo_uri("astronaut.png")] * 5)
    assert resp.status_code == 400 and "at most 4" in resp.json()["error"]["message"].lower()
    assert _chat(guarded, model_name, photo_uri("astronaut.png")).status_code == 200


def test_oversized_body_is_413(guarded: ServerProcess, model_name: str) -> None:
    big = "data:image/png;base64," + base64.b64encode(b"\0" * (9 * 1024 * 1024)).decode()
    resp = _chat(guarded, model_name, big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    assert _chat(guarded, model_name, photo_uri("astronaut.png")).status_code == 200


def test_api_key(guarded: ServerProcess, model_name: str) -> None:
    assert _chat(guarded, model_name, photo_uri("astronaut.png"), headers={}).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert _chat(guarded, model_name, photo_uri("astronaut.png"), headers=wrong).status_code == 401
    assert _chat(guarded, model_name, photo_uri("astronaut.png")).status_code == 200
    # Probes and metrics stay open for the orchestrator and Prometheus.
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200
    log = guarded.log_path.read_text()
    assert KEY not in log
    assert "Is anyone wearing a helmet?" not in log  # no prompt text in the logs by default
    assert "base64," not in log  # nor image data


def test_past_the_inflight_bound_is_429_with_retry_after(guarded: ServerProcess, model_name: str) -> None:
    """3 long streams fill --guard-max-inflight 3; a 4th request is refused at once, not queued.

    Once all three streams have sent their first event the engine core is SIGSTOPped until the 4th request
    has been answered, so no stream can finish early. (Not reading them was not enough: on a machine with
    larger loopback socket buffers a whole 3000-token stream fit in them and the 4th request was admitted.)
    """
    started, checked = threading.Barrier(4), threading.Event()
    body = {
        "model": model_name, "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 3000, "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 5,
    }  # fmt: skip
    statuses: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", guarded.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=300) as r:
            lines = r.iter_lines()
            next(lines)  # the first event: this stream is in flight
            started.wait(120)
            checked.wait(120)  # stay in flight until the 4th request has been answered
            for _ in lines:
                pass
            statuses.append(r.status_code)

    workers = [threading.Thread(target=stream) for _ in range(3)]
    for w in workers:
        w.start()
    started.wait(120)
    core = guarded.engine_core()
    core.send_signal(signal.SIGSTOP)  # well inside the 60 s hang timeout: no restart
    try:
        resp = _chat(guarded, model_name, photo_uri("astronaut.png"))
    finally:
        core.send_signal(signal.SIGCONT)
        checked.set()
    assert resp.status_code == 429 and resp.headers["Retry-After"].isdigit(), resp.text
    for w in workers:
        w.join(300)
    assert statuses == [200, 200, 200]
    assert _engine_generation(guarded) == ("ready", 0.0)  # the short stop was not taken for a hang
    assert _chat(guarded, model_name, photo_uri("astronaut.png")).status_code == 200


def test_prompt_longer_than_max_model_len_is_400(guarded: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "safety " * 6000}], "max_tokens": 4}
    resp = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=120)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400, resp.text
    assert _chat(guarded, model_name, photo_uri("astronaut.png")).status_code == 200
