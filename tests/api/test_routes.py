"""#44: vlguard serves vLLM's own routes (its app's, adopted whole), each through the transport, the door
and its route table (:mod:`server.api.routes`), and every body route meets the same choke points.

The routes are read from vLLM's own app on this lane (``build_app``), not listed here: a POST route a new
vLLM adds fails :func:`test_every_post_route_of_vllms_app_is_classified` until it is classified, and stays
refused (404) at the door meanwhile.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from server.api.routes import RouteKind, flat_routes, post_kind
from tests.api.test_media_layer import listener
from tests.inprocess import Api

KEY = "sk-routes"


def stock_routes(api: Api) -> list[Any]:
    """vLLM's own app for this server's arguments (what ``vllm serve`` would serve)."""
    from server.vllm_hooks.locations import vllm_symbol

    args = api.app.state.args
    app = vllm_symbol("build_app")(args, ("generate",), api.supervisor.latest_engine.model_config)
    return list(flat_routes(app.routes))


def post_paths(api: Api) -> list[str]:
    return sorted({r.path for r in stock_routes(api) if "POST" in r.methods})


def concrete(path: str) -> str:
    return path.replace("{response_id}", "resp_1")


async def test_every_post_route_of_vllms_app_is_classified(api: Api) -> None:
    unclassified = [p for p in post_paths(api) if post_kind(concrete(p)) is None]
    assert unclassified == [], "classify them in server/api/routes.py"


async def test_stock_routes_are_served(api: Api) -> None:
    """What stock serves and vlguard used to 404: ``/ping``, ``/invocations``, the render routes."""
    paths = {r.path for r in stock_routes(api)}
    assert (await api.client.get("/ping")).status_code == 200
    assert (await api.client.post("/ping")).status_code == 200
    body = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = await api.client.post("/invocations", json=body)
    assert resp.status_code == 200 and resp.json()["object"] == "chat.completion", resp.text[:300]
    if "/v1/chat/completions/render" in paths:
        resp = await api.client.post("/v1/chat/completions/render", json=body)
        assert resp.status_code == 200 or _scale_out_only(resp), resp.text[:300]


def _scale_out_only(resp: Any) -> bool:
    """vLLM 0.32 on serve the render routes only with ``--enable-scale-out`` (their own 403), as stock does."""
    return resp.status_code == 403 and "--enable-scale-out" in resp.json()["error"]["message"]


def _big_png() -> str:
    buf = io.BytesIO()
    Image.new("1", (12000, 12000)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _bodies(model: str, url: str) -> dict[str, dict[str, Any]]:
    """A body for each media-bearing route kind, with ``url`` as its image."""
    user = {
        "role": "user",
        "content": [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": url}}],
    }
    chat = {"model": model, "max_tokens": 2, "messages": [user]}
    item = {"type": "input_image", "image_url": url, "detail": "auto"}
    responses = {"model": model, "max_output_tokens": 2, "input": [{"role": "user", "content": [item]}]}
    image = {"type": "image", "source": {"type": "url", "url": url}}
    messages = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [image]}]}
    return {
        "/v1/chat/completions": chat,
        "/invocations": chat,
        "/tokenize": {"model": model, "messages": chat["messages"]},
        "/v1/chat/completions/render": chat,
        "/v1/responses": responses,
        "/v1/responses/render": responses,
        "/v1/messages": messages,
        "/v1/messages/count_tokens": messages,
        "/v1/messages/render": messages,
    }


async def test_every_media_route_meets_the_media_policy(api: Api) -> None:
    """For each media-bearing route vLLM's app has on this lane: a remote URL (remote media off) reaches no
    listener and an oversized image is refused from its header; never a 5xx."""
    paths = set(post_paths(api))
    big = _big_png()
    async with listener() as (port, connections):
        url = f"http://127.0.0.1:{port}/x.png"
        tried = []
        for path, body in _bodies(api.model, url).items():
            if path not in paths:
                continue
            tried.append(path)
            resp = await api.client.post(path, json=body)
            assert 400 <= resp.status_code < 500, (path, resp.status_code, resp.text[:200])
            resp = await api.client.post(path, json=_bodies(api.model, big)[path])
            assert 400 <= resp.status_code < 500, (path, resp.status_code, resp.text[:200])
            assert "pixels" in resp.json()["error"]["message"] or _scale_out_only(resp), (path, resp.text[:300])
        assert connections == []
    assert {"/v1/chat/completions", "/v1/responses", "/tokenize", "/invocations"} <= set(tried)


async def test_every_body_route_needs_the_key_before_its_body(make_api: Any) -> None:
    api = await make_api("--api-key", KEY)
    for path in post_paths(api):
        kind = post_kind(concrete(path))
        if kind is not None and kind[0] is RouteKind.REFUSED:
            continue
        resp = await api.client.post(concrete(path), json={})
        assert resp.status_code == 401, (path, resp.status_code, resp.text[:200])


@pytest.mark.parametrize("path", ["/inference/v1/abort_requests", "/scale_elastic_ep", "/v1/chat/completions/batch"])
async def test_internal_routes_are_refused_at_the_door(api: Api, path: str) -> None:
    resp = await api.client.post(path, json={})
    assert resp.status_code == 404 and "not served" in resp.json()["error"]["message"]


async def test_server_load_tracking_works_as_stock(make_api: Any) -> None:
    """``--enable-server-load-tracking``: vLLM's own ``/load`` route and its counting, as stock serves them."""
    api = await make_api("--enable-server-load-tracking")
    resp = await api.client.get("/load")
    assert resp.status_code == 200 and resp.json() == {"server_load": 0}, resp.text[:200]
    body = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await api.client.post("/v1/chat/completions", json=body)).status_code == 200
    assert (await api.client.get("/load")).json() == {"server_load": 0}  # counted in, then out


async def test_every_route_without_inputs_bounds_its_token_ids_values_and_objects(api: Api) -> None:
    """Hostile review: the routes that take no prompt (detokenize, derender) skipped the door's value and
    object bounds, and 20 million ids to /detokenize held the event loop 4-5 s (+2.2 GB). Each such route
    vLLM's app has on this lane now refuses more token ids than --guard-max-sequences (16) sequences of the
    context (the tiny profile's 4096) and more objects than the bound, before vLLM validates the body."""
    bound = 16 * 4096
    tried = []
    for path in post_paths(api):
        kind = post_kind(concrete(path))
        if kind is None or kind[0] is not RouteKind.NO_INPUT:
            continue
        tried.append(path)
        resp = await api.client.post(concrete(path), json={"model": api.model, "tokens": [1] * (bound + 1)})
        assert resp.status_code == 400 and "token ids" in resp.json()["error"]["message"], (path, resp.text[:300])
        resp = await api.client.post(concrete(path), json={"model": api.model, "x": [{}] * 10_001})
        assert resp.status_code == 413 and "JSON objects" in resp.json()["error"]["message"], (path, resp.text[:300])
    assert "/detokenize" in tried
    ok = await api.client.post("/detokenize", json={"model": api.model, "tokens": [1] * bound})
    assert ok.status_code == 200, ok.text[:300]


async def test_vllms_routes_skip_the_shells_router_and_vlguards_own_do_not(api: Api) -> None:
    """A request for none of vlguard's routes goes from the door to vLLM's app directly (ToStockApp), past
    the shell's exception layer, exit stack and router it would only fall through; a path that may be
    vlguard's own still meets the shell's router."""
    from server.api.stock_app import ToStockApp

    assert (await api.client.get("/health")).status_code == 200  # the middleware stack is built now
    layer = api.app.middleware_stack
    while not isinstance(layer, ToStockApp):
        layer = layer.app
    to_shell: list[str] = []
    shell = layer.app

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        to_shell.append(scope["path"])
        await shell(scope, receive, send)

    layer.app = spy
    try:
        models = await api.client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == api.model
        assert (await api.client.get("/no/such/route")).status_code == 404  # vLLM's app's 404, as before
        assert to_shell == []
        for path in ("/health", "/ready", "/version", "/metrics", "/admin/quarantine", "/admin/quarantine/ab12"):
            await api.client.get(path)
        await api.client.get("/health/", follow_redirects=False)  # the shell's router: its slash redirect
        assert to_shell == [
            "/health", "/ready", "/version", "/metrics", "/admin/quarantine", "/admin/quarantine/ab12", "/health/"
        ]  # fmt: skip
    finally:
        layer.app = shell
