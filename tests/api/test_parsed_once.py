"""#46 item 3, parse once: vLLM's routes take the door's parse of a body instead of parsing it again
(``json.loads`` on the event loop: ~1.4 ms for a body with a 300 KB image; :mod:`server.api.parsed_body`).
The answers are the same as when the route parsed the body itself."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from typing import Any

import pytest
import starlette.requests

from server.guard.states import EngineState
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


#: What :func:`redacting_logger` read of each body: (its parse before the route ran, the same after).
LOGGED: list[tuple[Any, Any]] = []


async def redacting_logger(request: Any, call_next: Any) -> Any:
    """A ``--middleware`` that reads the body, logs a redacted copy of its parse, and checks afterwards that
    nothing else changed that parse."""
    body = await request.json()
    if isinstance(body, dict) and "prompt" in body:
        body["prompt"] = "[redacted]"  # its own parse: the route must not see this
    before = json.loads(json.dumps(body))
    response = await call_next(request)
    LOGGED.append((before, body))
    return response


async def test_a_middleware_and_the_route_each_get_a_parse_of_their_own(make_api: Any) -> None:
    """Hostile review: a ``--middleware`` that read the body shared the door's one parse with vLLM's route.
    A redaction made for a log reached the engine, and SageMaker's adapter id injection on /invocations
    changed the middleware's parse (``model`` became null). Stock gives each reader its own."""
    api: Api = await make_api("--middleware", f"{__name__}.redacting_logger")
    LOGGED.clear()
    completion = {"model": api.model, "prompt": [1, 2, 3], "max_tokens": 2}
    assert (await api.client.post("/v1/completions", json=completion)).status_code == 200
    assert api.engine.prompts[api.engine.requests[-1]] == [1, 2, 3]  # before: the redaction's tokens
    assert (await api.client.post("/invocations", json=completion)).status_code == 200
    assert [after == before for before, after in LOGGED] == [True, True]  # before: /invocations' was changed


async def test_a_request_held_for_the_engine_keeps_its_bytes_not_their_parse(api: Api) -> None:
    """Hostile review: a request held while the engine restarts kept the door's parse beside its bytes, and
    the body budget counts bytes: two 602 KB bodies of nested empty lists held 39.7 MB instead of 1.2 MB
    (33x their bytes; the test sends 150 KB ones, parsed under tracemalloc in a quarter of the time). A
    held request now drops the parse; its route parses the body once the engine is back."""
    nest = b"[" * 150 + b"]" * 150
    raw = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "x": [%s]}' % (
        api.model.encode(),
        b",".join([nest] * 500),
    )
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    api.supervisor.states.set(EngineState.RESTARTING)
    headers = {"content-type": "application/json"}
    tasks = [asyncio.create_task(api.client.post(CHAT, content=raw, headers=headers)) for _ in range(2)]
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while api.supervisor.states.held < 2:  # both wait at the door with their bodies read
            assert asyncio.get_running_loop().time() < deadline, "the requests were never held"
            await asyncio.sleep(0.01)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        api.supervisor.states.set(EngineState.READY)
        responses = await asyncio.gather(*tasks)
        tracemalloc.stop()
    assert [r.status_code for r in responses] == [200, 200], [r.text[:200] for r in responses]
    assert held < 8 * len(raw), f"{held} bytes held for two held bodies of {len(raw)}"
