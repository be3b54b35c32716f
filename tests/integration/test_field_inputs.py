"""Field inputs (issue #17) on a real vlguard server: each row of the issue's table, on the session's
shared server (no launch of its own). The whole kind of each row is covered in-process
(tests/api/test_field_inputs.py, tests/unit/test_pixels.py)."""

from __future__ import annotations

import http.client
import time

import httpx
import psutil
import pytest
from openai import OpenAI

from server.workload.images import data_uri
from tests.helpers import chat_body, field_images, png
from tests.servers import ServerProcess

pytestmark = pytest.mark.lane  # one case per row in every engine lane

FIELD = field_images()


def greedy(client: OpenAI, model: str, image: bytes) -> tuple[list[str], list[float]]:
    """Six greedy tokens for ``image`` and the first token's top-5 logprobs (a fingerprint of the pixels)."""
    resp = client.chat.completions.create(
        model=model,
        messages=chat_body(model, data_uri(image, "image/png"))["messages"],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    return [t.token for t in content], [round(t.logprob, 4) for t in content[0].top_logprobs]


@pytest.mark.parametrize("row", sorted(FIELD))
def test_the_model_answers_the_picture_people_see(openai_client: OpenAI, model_name: str, row: str) -> None:
    sent, shown, stock = FIELD[row]
    answer = greedy(openai_client, model_name, sent)
    assert answer == greedy(openai_client, model_name, shown), f"{row}: answered unlike the picture people see"
    assert answer != greedy(openai_client, model_name, stock)  # what stock 0.20 answers: the test can tell


def test_huge_min_pixels_is_refused_up_front(server: ServerProcess, model_name: str) -> None:
    api = psutil.Process(server.proc.pid)  # type: ignore[union-attr]
    rss_before = api.memory_info().rss
    body = chat_body(model_name, data_uri(png(64, 64), "image/png"), mm_processor_kwargs={"min_pixels": 10**10})
    started = time.monotonic()
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and "processed image bound" in resp.json()["error"]["message"], resp.text
    assert time.monotonic() - started < 5
    assert api.memory_info().rss - rss_before < 100 << 20  # stock: 1.2 GB -> 18.7 GB and 54 s of CPU


@pytest.mark.parametrize("content_type", [None, "text/plain"])
def test_json_without_a_json_content_type_is_400(server: ServerProcess, model_name: str, content_type: str) -> None:
    raw = httpx.Request("POST", "/", json=chat_body(model_name)).content
    headers = {"content-type": content_type} if content_type else {}
    resp = httpx.post(server.url + "/v1/chat/completions", content=raw, headers=headers, timeout=60)
    assert resp.status_code == 400 and "application/json" in resp.json()["error"]["message"], resp.text


def test_completions_max_tokens_null_is_the_default(server: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "prompt": "safety check", "max_tokens": None, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text  # stock 0.20: 500 (an assert in vLLM's response builder)
    assert resp.json()["usage"]["completion_tokens"] == 16  # the field's default, as vLLM 0.32 decides


def test_an_idle_pooled_connection_is_kept_past_proxy_reuse(server: ServerProcess) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        sock = conn.sock
        time.sleep(7)  # the idle time under test: a proxy's pool reuses the connection after 7 s
        conn.request("GET", "/health")  # uvicorn's default (5 s) had closed it: RemoteDisconnected here
        again = conn.getresponse()
        assert again.status == 200 and again.read() and conn.sock is sock  # the same connection
    finally:
        conn.close()
