"""#46: the front-end flags vLLM's app builder reads behave as stock, because vlguard serves the app
``build_app`` makes (:mod:`server.api.stock_app`): each checked over HTTP, in-process."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.inprocess import Api

KEY = "sk-parity"


class TaggingMiddleware:
    """A ``--middleware`` class: tags every response it sees."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-parity-middleware", b"seen")]
            await send(message)

        await self.app(scope, receive, tagged)


async def test_middleware_runs_on_vllms_routes(make_api: Any) -> None:
    api: Api = await make_api("--middleware", f"{__name__}.TaggingMiddleware")
    resp = await api.client.get("/v1/models")
    assert resp.status_code == 200 and resp.headers["x-parity-middleware"] == "seen"
    body = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await api.client.post("/v1/chat/completions", json=body)).headers["x-parity-middleware"] == "seen"


async def test_request_id_headers(make_api: Any, api: Api) -> None:
    assert "x-request-id" not in (await api.client.get("/v1/models")).headers  # off by default, as stock
    with_ids: Api = await make_api("--enable-request-id-headers")
    assert (await with_ids.client.get("/v1/models")).headers["x-request-id"]
    resp = await with_ids.client.get("/v1/models", headers={"X-Request-Id": "abc-1"})
    assert resp.headers["x-request-id"] == "abc-1"  # vLLM's middleware echoes the client's


async def test_docs_as_stock(make_api: Any, api: Api) -> None:
    online = await api.client.get("/docs")
    assert online.status_code == 200 and "cdn.jsdelivr.net" in online.text
    assert "/v1/chat/completions" in (await api.client.get("/openapi.json")).json()["paths"]
    offline: Api = await make_api("--enable-offline-docs")
    resp = await offline.client.get("/docs")
    assert resp.status_code == 200 and "cdn.jsdelivr.net" not in resp.text, resp.text[:300]
    none: Api = await make_api("--disable-fastapi-docs")
    assert (await none.client.get("/docs")).status_code == 404
    assert (await none.client.get("/openapi.json")).status_code == 404


async def test_api_key_on_v1_reads(make_api: Any) -> None:
    api: Api = await make_api("--api-key", KEY)
    resp = await api.client.get("/v1/models")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == 401  # in the envelope (vLLM's is not)
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "GET"}
    assert (await api.client.options("/v1/models", headers=preflight)).status_code != 401  # as vLLM's
    assert (await api.client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
    assert (await api.client.get("/health")).status_code == 200  # probes stay open, as stock


async def test_server_load_tracking(make_api: Any) -> None:
    api: Api = await make_api("--enable-server-load-tracking")
    resp = await api.client.get("/load")
    assert resp.status_code == 200 and resp.json() == {"server_load": 0}


@pytest.mark.parametrize("flag", [(), ("--log-error-stack",)])
async def test_log_error_stack(make_api: Any, flag: tuple[str, ...], caplog: pytest.LogCaptureFixture) -> None:
    api: Api = await make_api(*flag)
    with caplog.at_level(logging.ERROR, logger="server.api.errors"):
        resp = await api.client.post("/v1/chat/completions", json={"model": api.model, "messages": "x"})
    assert resp.status_code == 400
    stacks = [r for r in caplog.records if r.name == "server.api.errors" and r.exc_info]
    assert bool(stacks) == bool(flag), [r.getMessage() for r in caplog.records]


async def test_an_engine_error_does_not_stop_the_server(api: Api) -> None:
    """vLLM's own handler stops the server on an engine error; vlguard's map answers it and serves on."""
    from vllm.v1.engine.exceptions import EngineGenerateError

    stock = api.app.router.default.app
    handlers = stock.exception_handlers
    assert all(not str(getattr(h, "__module__", "")).startswith("vllm.") for h in handlers.values())
    assert EngineGenerateError not in handlers  # left to vlguard's catch-all: vLLM's status, no shutdown


async def test_cors_once_on_vllms_routes_and_on_the_doors_refusals(make_api: Any) -> None:
    """CORS comes from vlguard's shell (vLLM's app leaves its own out): one set of headers on vLLM's
    routes, and the same on a refusal of the door, which vLLM's app never sees."""
    api: Api = await make_api("--allowed-origins", '["https://ui.example"]')
    origin = {"Origin": "https://ui.example"}
    resp = await api.client.get("/v1/models", headers=origin)
    assert resp.headers.get_list("access-control-allow-origin") == ["https://ui.example"]
    nan = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    door = await api.client.post("/v1/chat/completions", content=nan, headers=origin)
    assert door.status_code == 400 and "not a finite JSON number" in door.json()["error"]["message"]
    assert door.headers.get_list("access-control-allow-origin") == ["https://ui.example"]


async def test_vllms_app_lifespan_runs_inside_vlguards(engine_parts: Any) -> None:
    """vLLM's app's own lifespan (stats logging, the start-up heap frozen, its shutdown hooks) runs inside
    vlguard's, as vllm serve runs it: it ends by dropping the app's state."""
    from tests.inprocess import running_api

    async with running_api(engine_parts) as api:
        vllm_app = api.app.router.default.app
        assert vllm_app.state.engine_client is not None
        assert (await api.client.get("/v1/models")).status_code == 200
    assert not hasattr(vllm_app, "state")


async def test_stats_logging_survives_an_engine_between_lives() -> None:
    from server.guard.engine_client import GuardedEngineClient

    class Dead:
        async def do_log_stats(self) -> None:
            raise RuntimeError("engine dead")

    class Port:
        latest_engine = Dead()

    await GuardedEngineClient(Port()).do_log_stats()  # type: ignore[arg-type]  # never raises


async def test_a_websocket_to_an_http_route_is_refused_not_a_500(api: Api) -> None:
    """A websocket handshake on a route vLLM's app serves over HTTP only (``/metrics``'s Prometheus app
    asserts HTTP) is refused; vlguard's error map closed it instead of failing on a request without a
    method. The server serves on."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    client = TestClient(api.app.router.default.app)  # not entered: vLLM's app's lifespan is vlguard's to run
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/metrics"):
        pass
    assert closed.value.code == 1011
    assert (await api.client.get("/health")).status_code == 200
