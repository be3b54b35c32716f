"""The transport's header checks (server/api/transport.py) in front of every route: a request that repeats
a credential, its id or its content type is refused with 400 before the API key or the body is read, and
the client's identity is the credential vLLM authenticated (CASES: #44 identity)."""

from __future__ import annotations

from typing import Any

import pytest

from server.api.transport import repeated_header
from server.guard.clients import address_key, client_key
from tests.inprocess import Api

KEY = "sk-one"


def test_repeated_header_names_the_first_repeat() -> None:
    assert repeated_header([(b"authorization", b"a"), (b"accept", b"x"), (b"accept", b"y")]) is None
    assert repeated_header([(b"authorization", b"a"), (b"authorization", b"b")]) == "authorization"
    assert repeated_header([(b"x-request-id", b"1"), (b"content-type", b"a"), (b"x-request-id", b"1")]) == (
        "x-request-id"
    )


def test_a_client_is_its_ipv6_prefix_and_mapped_loopback_is_loopback() -> None:
    assert address_key("::ffff:127.0.0.1") == ""  # IPv4-mapped loopback: a local proxy, no identity
    assert address_key("::1") == "" and address_key("127.0.0.9") == "" and address_key("nonsense") == ""
    assert address_key("::ffff:198.51.100.7") == "addr:198.51.100.7"
    assert address_key("2001:db8:1:2::17") == address_key("2001:db8:1:2:ffff::1") == "addr:2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::17") != address_key("2001:db8:1:2::17")
    # With several keys the client is the key vLLM checks: the first Authorization header.
    two = {"headers": [(b"authorization", b"Bearer sk-a"), (b"authorization", b"Bearer sk-b")], "client": None}
    one = {"headers": [(b"authorization", b"Bearer sk-a")], "client": None}
    assert client_key(two, keys=2) == client_key(one, keys=2)


ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("GET", "/admin/quarantine", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
async def test_two_authorization_headers_are_refused_on_every_route(
    make_api: Any, method: str, path: str, body: dict[str, Any] | None
) -> None:
    api: Api = await make_api("--api-key", KEY)
    if body is not None:
        body = {"model": api.model, **body}
    good = [("authorization", f"Bearer {KEY}")]
    for headers in ([*good, ("authorization", "Bearer sk-other")], [("authorization", "Bearer sk-other"), *good]):
        resp = await api.client.request(method, path, json=body, headers=headers)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "authorization" and "only once" in error["message"]
    ok = await api.client.request(method, path, json=body, headers=good)
    assert ok.status_code == 200, ok.text


async def test_a_repeated_content_type_or_request_id_is_refused(api: Api) -> None:
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 1}'
    for name, values in (("content-type", ("application/json", "text/plain")), ("x-request-id", ("a", "a"))):
        headers = [(name, v) for v in values]
        if name != "content-type":
            headers.append(("content-type", "application/json"))
        resp = await api.client.post("/v1/completions", content=body, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name, resp.text


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/chat/completions", "/v1/not-a-route"])
async def test_with_a_key_a_body_without_one_is_refused_on_every_route(make_api: Any, path: str) -> None:
    """#44: vLLM's key middleware guards /v1 only; /tokenize and /detokenize took input without a key."""
    api: Api = await make_api("--api-key", KEY)
    body = {"model": api.model, "prompt": "hi", "tokens": [1, 2], "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": KEY}):
        resp = await api.client.post(path, json=body, headers=headers)
        assert resp.status_code == 401, (headers, resp.text)
        assert resp.json()["error"]["param"] == "authorization" and resp.headers["www-authenticate"] == "Bearer"
    if path in ("/tokenize", "/detokenize"):
        ok = await api.client.post(path, json=body, headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
    assert (await api.client.get("/health")).status_code == 200  # no key needed to tell it is alive


async def test_an_unauthenticated_body_is_never_read() -> None:
    """The refusal comes before the body: a stalled anonymous upload holds nothing."""
    from server.api.transport import TransportMiddleware

    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app was called")

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/detokenize", "root_path": "", "headers": []}
    await TransportMiddleware(app, keys=[KEY])(scope, receive, send)
    assert sent[0]["status"] == 401
