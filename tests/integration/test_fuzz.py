"""Property-based fuzzing of ``POST /v1/chat/completions`` on the real server (hypothesis, bounded and
derandomized): whatever the body, the answer is never a 5xx and the engine never dies."""

from __future__ import annotations

import io
from typing import Any

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from server.workload.images import data_uri
from tests.conftest import OPERATOR_KEY
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


#: Fields the engine core reads (sampling, structured outputs, token ids, truncation), with values around
#: the edges where vLLM's engine has faulted (#33): empty or false constraints, ids past the vocabulary,
#: placeholders in text, truncation into an image.
ENGINE_FIELDS = {
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({}, optional={
            "json_object": st.one_of(st.booleans(), st.none()),
            "json": st.one_of(st.sampled_from(["", " ", "{}", '{"type": "object"}', '{"type": "strin"}', "{"]),
                              st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "bogus"])})),
            "regex": st.sampled_from(["", "(ab", "(ab){2}c", "[0-9]+", "a{0}"]),
            "choice": st.one_of(st.lists(st.text(max_size=4), max_size=3), st.lists(st.integers(), max_size=2)),
            "grammar": st.sampled_from(["", 'root ::= "a" | "b"', "root ::= ( ", "start: /x/"]),
        }),
        SCALARS,
    ),
    "response_format": st.one_of(FORMATS, st.fixed_dictionaries({
        "type": st.just("json_schema"),
        "json_schema": st.fixed_dictionaries({"name": st.just("v"), "schema": st.sampled_from(
            [{}, {"type": "object"}, {"type": "strin"}, {"type": "array", "minItems": 3, "maxItems": 1}])}),
    })),
    "stop_token_ids": st.lists(st.integers(-2, 2**31), max_size=3),
    "min_tokens": st.integers(-1, 20),
    "max_tokens": st.integers(1, 12),
    "logit_bias": st.dictionaries(st.integers(-2, 2**20).map(str), st.floats(-200, 200), max_size=2),
    "allowed_token_ids": st.lists(st.integers(-1, 2**20), max_size=3),
    "frequency_penalty": st.floats(-3, 3),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "temperature": st.floats(0, 3),
    "top_k": st.integers(-2, 2000),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-5, 2**63),
    "truncate_prompt_tokens": st.integers(-2, 300),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
}  # fmt: skip
TEXT_TURN = [{"role": "user", "content": "Is the exit clear?"}]
ENGINE_TEXT = st.sampled_from(["Is the exit clear?", "see <|image_pad|> here", "<|vision_start|>", "hi", ""])


def engine_body(model: str) -> st.SearchStrategy[dict[str, Any]]:
    content = st.one_of(
        ENGINE_TEXT,
        st.tuples(ENGINE_TEXT, st.booleans()).map(
            lambda t: [{"type": "text", "text": t[0]}] + ([{"type": "image_url", "image_url": {"url": _small_png()}}]
                                                           if t[1] else [])
        ),
    )  # fmt: skip
    messages = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": content}), min_size=1, max_size=2)
    return st.fixed_dictionaries({"model": st.just(model), "messages": messages}, optional=ENGINE_FIELDS)


def test_engine_fields_never_5xx_never_rebuild_at_most_k_faults_each(server: ServerProcess, model_name: str) -> None:
    """#33: requests drawn over the fields the engine core reads. Whatever they hold: never a 5xx, never a
    rebuild, and no fingerprint charged with more than the quarantine's K faults (one that faults is
    refused after K, with 400)."""

    def rebuilds() -> float:
        samples = metric_samples(server.url, "vlguard_engine_recoveries", by_label="kind")
        return samples.get("vlguard_engine_recoveries_total{rebuild}", 0.0)

    before = rebuilds()
    seen: dict[int, int] = {}

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(payload=engine_body(model_name))
    @example(payload={"model": model_name, "messages": TEXT_TURN, "structured_outputs": False})  # found: a 500
    def one(payload: dict[str, Any]) -> None:
        resp = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=120)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (payload, resp.text[:500])

    one()
    assert sum(seen.values()) == 81 and seen.get(200, 0) >= 10 and seen.get(400, 0) >= 10, seen
    assert rebuilds() == before
    quarantine = httpx.get(server.url + "/admin/quarantine", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}).json()
    assert all(entry["strikes"] <= quarantine["quarantine_deaths"] for entry in quarantine["entries"]), quarantine
    assert httpx.get(server.url + "/ready").status_code == 200
