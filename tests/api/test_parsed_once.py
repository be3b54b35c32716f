"""#46 item 3, parse once: vLLM's routes take the door's parse of a body instead of parsing it again
(``json.loads`` on the event loop: ~1.4 ms for a body with a 300 KB image; :mod:`server.api.parsed_body`).
The answers are the same as when the route parsed the body itself."""

from __future__ import annotations

import json
from typing import Any

import pytest
import starlette.requests

from server.workload.images import photo_uri
from tests.helpers import chat_body
from tests.inprocess import Api

CHAT = "/v1/chat/completions"


class _CountingJson:
    """Starlette's ``json`` module with ``loads`` counted (what a route parsed itself)."""

    def __init__(self) -> None:
        self.parsed: list[int] = []  # the size of each body parsed

    def loads(self, raw: Any, **kwargs: Any) -> Any:
        self.parsed.append(len(raw))
        return json.loads(raw, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


@pytest.fixture
def route_parses(monkeypatch: pytest.MonkeyPatch) -> _CountingJson:
    counting = _CountingJson()
    monkeypatch.setattr(starlette.requests, "json", counting)
    return counting


async def test_vllms_routes_take_the_doors_parse(api: Api, route_parses: _CountingJson) -> None:
    image = photo_uri("astronaut.png")
    plain = chat_body(api.model, image, max_tokens=2)
    uuid_dropped = chat_body(api.model, image, max_tokens=2)  # the door rewrites it: hands on its new parse
    uuid_dropped["messages"][0]["content"][1]["uuid"] = "client-picked"
    for path, body in (
        (CHAT, plain),
        (CHAT, uuid_dropped),
        ("/v1/completions", {"model": api.model, "prompt": [1, 2, 3], "max_tokens": 2}),
        ("/tokenize", {"model": api.model, "prompt": "hello"}),
        ("/detokenize", {"model": api.model, "tokens": [1, 2]}),  # a route that takes no input
    ):
        resp = await api.client.post(path, json=body)
        assert resp.status_code == 200, (path, resp.text)
    assert route_parses.parsed == []  # before: each route parsed its body again (five parses here)
    prompt = api.engine.prompts[api.engine.requests[-1]]  # the completion's (tokenize and detokenize do not reach it)
    assert prompt == [1, 2, 3]


async def test_a_body_the_door_cannot_parse_is_answered_by_vllms_own_parse(
    api: Api, route_parses: _CountingJson
) -> None:
    resp = await api.client.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    assert route_parses.parsed == [10]  # nothing handed over: vLLM's route parsed it (and refused it)
