"""#44: property-based requests against vlguard in-process, shaped from vLLM's own request models: for each
body route of vLLM's app, a valid body with one field of the route's request model (its field names read
from the model, so a field a later vLLM adds is fuzzed too) set to a hostile value (wrong types, integers
beyond 64 bits, floats at the edge, unknown content parts, deep nesting). Whatever the body: never a 5xx.

Bounded and derandomized: the same examples every run, about a second per route.
"""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.api.test_routes import stock_routes
from tests.inprocess import Api

SCALARS = st.one_of(
    st.none(), st.booleans(), st.text(max_size=20),
    st.integers(-(2**70), 2**70), st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 5e-324, -0.0]),
)  # fmt: skip
UNKNOWN_PART = st.dictionaries(
    st.sampled_from(["type", "text", "image_url", "video_url", "input_audio", "file", "uuid", "x"]),
    st.one_of(SCALARS, st.sampled_from(["image_url", "video_url", "file", "input_image", "refusal", "image"])),
    max_size=4,
)
HOSTILE = st.recursive(
    st.one_of(SCALARS, UNKNOWN_PART),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)


#: A valid body per route, which the fuzzed field is put into.
def _valid(model: str) -> dict[str, dict[str, Any]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {
        "/v1/chat/completions": chat,
        "/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 2},
        "/v1/responses": {"model": model, "input": "hi", "max_output_tokens": 2},
        "/tokenize": {"model": model, "prompt": "hi"},
        "/invocations": chat,
        "/v1/chat/completions/render": chat,
    }


def request_model(route: Any) -> type[BaseModel] | None:
    """The pydantic model a vLLM route parses its body into (its ``request`` parameter), or None."""
    try:
        hints = typing.get_type_hints(route.endpoint)
    except Exception:
        return None
    found = hints.get("request")
    return found if isinstance(found, type) and issubclass(found, BaseModel) else None


def _examples(valid: dict[str, Any], names: list[str]) -> list[tuple[str, str]]:
    """``(field, body)`` pairs: ``valid`` with one of ``names`` set to a hostile value (hypothesis, derandomized)."""
    found: list[tuple[str, str]] = []

    @settings(max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(names), value=HOSTILE)
    def collect(name: str, value: Any) -> None:
        found.append((name, json.dumps({**valid, name: value})))

    collect()
    return found


def fields_by_route(api: Api) -> dict[str, list[str]]:
    fields = {}
    for route in stock_routes(api):
        if "POST" in route.methods and route.path in _valid(api.model) and (model := request_model(route)):
            fields[route.path] = sorted(model.model_fields)
    return fields


async def test_hostile_fields_of_vllms_request_models_never_answer_5xx(api: Api) -> None:
    fields = fields_by_route(api)
    assert {"/v1/chat/completions", "/v1/completions"} <= set(fields), fields.keys()
    valid = _valid(api.model)
    answers: list[tuple[str, str, int, str]] = []

    for path, names in fields.items():
        answers += [(path, name, 0, body) for name, body in _examples(valid[path], names)]
    for i, (path, name, _, body) in enumerate(answers):
        resp = await api.client.post(path, content=body, headers={"content-type": "application/json"})
        answers[i] = (path, name, resp.status_code, resp.text[:200])
    server_errors = [a for a in answers if a[2] >= 500]
    assert server_errors == [], server_errors[:5]
    assert len(answers) >= 40 * len(fields)


@pytest.mark.parametrize("part", [
    {"type": "file", "file": {"file_data": "AAAA"}}, {"type": "input_file"}, {"type": "image", "source": {}},
    {"type": "nonsense"}, {"image_url": 5}, {"video_url": {"url": None}},
])  # fmt: skip
async def test_unknown_content_parts_are_a_4xx(api: Api, part: dict[str, Any]) -> None:
    body = {"model": api.model, "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    resp = await api.client.post("/v1/chat/completions", json=body)
    assert 400 <= resp.status_code < 500, (part, resp.status_code, resp.text[:200])
