"""#33 through a real server on the real engine: inputs known to fault vLLM's engine core are refused at
the door with 400, before the engine sees them (zero engine faults), one per kind on every lane; and
vLLM's 500 for a truncation into an image is a 400 (CASES C16, C21)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from server.workload.images import photo_uri
from tests.helpers import POISON_CASES, metric
from tests.servers import ServerProcess

pytestmark = pytest.mark.lane  # in every engine lane's focused suite

TEXT = [{"role": "user", "content": "Is the exit clear?"}]
IMAGE = {"type": "image_url", "image_url": {"url": photo_uri("coffee.png")}}

CASES: dict[str, tuple[dict[str, Any], str]] = {
    **POISON_CASES,
    "literal-placeholder-beside-an-image": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "see <|image_pad|>"}, IMAGE]}]},
        "placeholder",
    ),
    "truncation-into-image": (
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE]}],
            "truncate_prompt_tokens": 5,
        },
        "placeholder of every image",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_known_poison_is_refused_with_zero_engine_faults(server: ServerProcess, model_name: str, case: str) -> None:
    extra, needle = CASES[case]
    deaths = metric(server, "vlguard_engine_deaths_total")
    body = {"model": model_name, "messages": TEXT, "max_tokens": 4, **extra}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    assert metric(server, "vlguard_engine_deaths_total") == deaths


def test_a_nan_sampling_value_is_refused(server: ServerProcess, model_name: str) -> None:
    raw = json.dumps({"model": model_name, "messages": TEXT, "max_tokens": 4})[:-1] + ', "temperature": NaN}'
    resp = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=60,
                      headers={"content-type": "application/json"})  # fmt: skip
    assert resp.status_code == 400 and "finite" in resp.json()["error"]["message"]


def test_valid_constraints_are_served(server: ServerProcess, model_name: str) -> None:
    for extra, check in [
        ({"structured_outputs": {"regex": "(ab){3}c"}}, lambda text: text == "abababc"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "v", "schema": {"enum": ["ok", "stop"]}},
                }
            },
            lambda text: json.loads(text) in ("ok", "stop"),
        ),
    ]:
        body = {"model": model_name, "messages": TEXT, "max_tokens": 40, "temperature": 0, **extra}
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert check(resp.json()["choices"][0]["message"]["content"])
