"""The OpenAI surface of a real vlguard server on a real vLLM engine (tiny Qwen3-VL, CPU)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from server.patches import KNOWN_PATCHES
from server.workload.images import data_uri, photo_bytes, photo_uri
from server.workload.twopass import primary_messages, rescue_messages
from tests.helpers import chat_body, metric
from tests.lanes import VLLM_VERSION, expected_patches
from tests.servers import ServerProcess

pytestmark = pytest.mark.lane  # in every engine lane's focused suite

PHOTOS = ["rocket.jpg", "astronaut.png", "camera.png", "logo.png"]  # JPEG, RGB, grayscale, RGBA
N_TOKENS = 6


@pytest.mark.parametrize("photo", PHOTOS)
def test_chat_with_photo_returns_requested_tokens(openai_client: OpenAI, model_name: str, photo: str) -> None:
    resp = openai_client.chat.completions.create(
        model=model_name,
        messages=primary_messages(photo_uri(photo)),  # type: ignore[arg-type]
        max_tokens=N_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == N_TOKENS
    assert resp.usage.prompt_tokens > 40  # the image's placeholder tokens are in the prompt


@pytest.mark.parametrize("photo", PHOTOS)
def test_streaming_chat_with_photo(openai_client: OpenAI, model_name: str, photo: str) -> None:
    stream = openai_client.chat.completions.create(
        model=model_name,
        messages=primary_messages(photo_uri(photo)),  # type: ignore[arg-type]
        max_tokens=N_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == N_TOKENS
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


def test_two_pass_primary_then_rescue(openai_client: OpenAI, model_name: str) -> None:
    image = photo_uri("coffee.png")
    usages = []
    for messages in (primary_messages(image), rescue_messages(image)):
        resp = openai_client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=4,
            temperature=0,  # type: ignore[arg-type]
        )
        assert resp.choices[0].message is not None
        assert resp.usage is not None
        usages.append(resp.usage.prompt_tokens)
    assert usages[1] > usages[0]  # the rescue prompt is longer


def test_text_completion(openai_client: OpenAI, model_name: str) -> None:
    resp = openai_client.completions.create(model=model_name, prompt="The safety check", max_tokens=3)
    assert resp.usage is not None and resp.usage.completion_tokens == 3


def test_models_lists_the_served_model(openai_client: OpenAI, model_name: str) -> None:
    assert [m.id for m in openai_client.models.list()] == [model_name]


def test_health_ready_version(server: ServerProcess) -> None:
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "alive", "engine": "ready"}
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    version = httpx.get(server.url + "/version").json()
    assert version["vllm_version"] == VLLM_VERSION
    assert version["version"]
    # Patch detection: exactly the backports this lane's vLLM needs, in /version and on /metrics.
    assert version["patches"]["enabled"] is True and version["patches"]["active"] == expected_patches()
    text = httpx.get(server.url + "/metrics").text
    for patch in KNOWN_PATCHES:
        value = "1.0" if patch in expected_patches() else "0.0"
        assert f'vlguard_patch_active{{patch="{patch}",vllm_version="{VLLM_VERSION}"}} {value}' in text


def test_metrics_include_vllm_series(server: ServerProcess, openai_client: OpenAI, model_name: str) -> None:
    openai_client.completions.create(model=model_name, prompt="hello", max_tokens=2)
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    assert "vllm:prompt_tokens_total" in resp.text
    assert "vllm:num_requests_running" in resp.text


def test_bad_image_is_a_400_and_the_engine_lives_on(server: ServerProcess, model_name: str) -> None:
    """CASES C8 on the real engine (the whole table runs in-process: tests/api/test_requests.py)."""
    jpeg = photo_bytes("rocket.jpg")
    deaths = metric(server, "vlguard_engine_deaths_total")
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                      json=chat_body(model_name, data_uri(jpeg[: len(jpeg) // 3], "image/jpeg")))  # fmt: skip
    assert resp.status_code == 400 and "truncated" in resp.json()["error"]["message"], resp.text
    good = httpx.post(
        server.url + "/v1/chat/completions", json=chat_body(model_name, photo_uri("rocket.jpg")), timeout=120
    )
    assert good.status_code == 200
    assert metric(server, "vlguard_engine_deaths_total") == deaths == 0
    log = server.log_path.read_text()
    assert "Is anyone wearing a helmet?" not in log and "base64," not in log  # no prompt text or image data logged


def test_a_request_the_engine_cannot_take_is_a_400_on_the_real_engine(server: ServerProcess, model_name: str) -> None:
    """#44: an integer beyond 64 bits in ``vllm_xargs`` cannot be serialised to the real engine core (vLLM:
    500 with an empty message); a tool without ``function`` fails a validator of vLLM's request model (vLLM:
    500 ``'function'``). Both are the client's 400 with a message, and the engine serves on. (The whole
    kind runs in-process: tests/api/test_requests.py.)"""
    deaths = metric(server, "vlguard_engine_deaths_total")
    cases = [({"vllm_xargs": {"k": 2**70}}, ("OverflowError", "2**64")),  # later vLLMs refuse it themselves
             ({"tools": [{"type": "function"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
              ("function",))]  # fmt: skip
    for extra, needles in cases:
        resp = httpx.post(server.url + "/v1/chat/completions", json=chat_body(model_name, **extra), timeout=120)
        assert resp.status_code == 400 and any(n in resp.json()["error"]["message"] for n in needles), resp.text
    assert httpx.post(server.url + "/v1/chat/completions", json=chat_body(model_name), timeout=120).status_code == 200
    assert metric(server, "vlguard_engine_deaths_total") == deaths


STREAM_REFUSALS = {
    "top_logprobs over --max-logprobs": ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "logprobs"),
    "prompt token id outside the vocabulary": ("/v1/completions", {"prompt": [1, 2, 10**9]}, "token"),
    "vllm_xargs beyond 64 bits": ("/v1/chat/completions", {"vllm_xargs": {"k": 2**70}}, "2**64"),
}


@pytest.mark.parametrize("case", STREAM_REFUSALS)
def test_a_stream_the_engine_refuses_is_a_400_before_its_200(server: ServerProcess, model_name: str, case: str) -> None:
    """CASES C24: vLLM starts a stream's 200 before its engine client checks the request, and the refusal
    came as the stream's error event (stock 0.20.0: 200, then ``data: {"error": ...}``). Streamed, it is the
    400 the same request gets unstreamed, in the OpenAI envelope."""
    path, extra, needle = STREAM_REFUSALS[case]
    body = {"model": model_name, "max_tokens": 2, "stream": True, **extra}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as resp:
        text = resp.read().decode()
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json"), text
    error = httpx.Response(400, content=text).json()["error"]
    assert error["code"] == 400 and needle in error["message"].lower(), error
    ok = {**body, "max_tokens": 2}
    ok.pop("logprobs", None), ok.pop("top_logprobs", None), ok.pop("vllm_xargs", None)
    if path == "/v1/completions":
        ok["prompt"] = [1, 2, 3]
    with httpx.stream("POST", server.url + path, json=ok, timeout=120) as resp:
        assert resp.status_code == 200 and "[DONE]" in resp.read().decode()
