"""Property-based fuzzing of ``POST /v1/chat/completions`` on the real server (hypothesis, bounded and
derandomized): whatever the body, the answer is never a 5xx and the engine never dies."""

from __future__ import annotations

import io
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from server.workload.images import data_uri
from tests.servers import ServerProcess, metric_samples


def _small_png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, "PNG")
    return data_uri(buf.getvalue(), "image/png")


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)  # fmt: skip
URLS = st.one_of(
    st.text(max_size=60),
    st.sampled_from([_small_png(), "data:image/png;base64,", "data:image/png;base64,AAAA", "data:,", "http://x"]),
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=120)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": URLS})}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": SCALARS}),
    st.dictionaries(st.text(max_size=10), SCALARS, max_size=3),
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "nobody"]),
            "content": st.one_of(st.text(max_size=120), st.lists(PART, max_size=3), SCALARS),
        }
    ),
    SCALARS,
)


FORMATS = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}), SCALARS)


def body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    messages = st.one_of(st.lists(MESSAGE, max_size=3), SCALARS)
    return st.fixed_dictionaries(
        {"model": st.sampled_from([model, "no-such-model"]), "messages": messages},
        optional={
            "max_tokens": st.one_of(st.integers(-5, 16), SCALARS),
            "temperature": st.one_of(st.floats(-3, 3, allow_nan=False), SCALARS),
            "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), SCALARS),
            "n": st.integers(-1, 3),
            "stream": st.booleans(),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(-2, 30),
            "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), SCALARS),
            "seed": st.one_of(st.integers(-(2**70), 2**70), SCALARS),
            "response_format": FORMATS,
        },
    )  # fmt: skip


def _deaths(srv: ServerProcess) -> float:
    return metric_samples(srv.url, "vlguard_engine_deaths").get("vlguard_engine_deaths_total", 0.0)


def test_chat_endpoint_never_answers_5xx(server: ServerProcess, model_name: str) -> None:
    deaths_before = _deaths(server)
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(payload=body(model_name))
    def one(payload: dict[str, Any]) -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=120) as resp:
            text = "\n".join(resp.iter_lines())  # a stream must end cleanly too
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (payload, text[:500])

    one()
    assert sum(seen.values()) == 150 and any(code == 200 for code in seen), seen
    assert _deaths(server) == deaths_before
    assert httpx.get(server.url + "/ready").status_code == 200
