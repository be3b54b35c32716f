"""Liveness, readiness, version, metrics, CORS and what a request meets while the engine is away: held,
then 503 + Retry-After; a quarantined request's 400; a stream that cannot be resumed ends with an error
event. In-process over the fake engine, whose death and slowness the test controls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from server.guard.supervisor import EngineState
from server.guard.watchdog import DeathCause
from tests.helpers import chat_body
from tests.inprocess import Api

CHAT = "/v1/chat/completions"
WAIT_S = 10


async def test_health_ready_version_metrics(api: Api) -> None:
    health = await api.client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "alive", "engine": "ready"}
    ready = await api.client.get("/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    version = (await api.client.get("/version")).json()
    assert set(version) == {"version", "vllm_version", "patches", "carry_over"}
    assert "structured outputs" in version["carry_over"]["rerun"]
    assert set(version["patches"]) >= {"enabled", "active"}
    metrics = await api.client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "vlguard_engine_up" in metrics.text and "vlguard_requests_held" in metrics.text


async def test_head_is_answered_wherever_get_is(api: Api) -> None:
    """#63: some probes and uptime checkers send HEAD; vLLM's and vlguard's routes answered 405. HEAD is
    GET's answer without its body; a route without GET still says 405."""
    for path in ("/health", "/ping", "/ready", "/metrics", "/version", "/v1/models"):
        get, head = await api.client.get(path), await api.client.head(path)
        assert head.status_code == get.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert (await api.client.head("/v1/chat/completions")).status_code == 405


async def test_restarting_engine_holds_requests_then_serves_them(api: Api) -> None:
    api.factory.gate.clear()  # the next engine "loads" until the test releases it
    api.supervisor.report_death(api.supervisor.generation, DeathCause.PROCESS_EXIT)
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.RESTARTING), WAIT_S)
    ready = await api.client.get("/ready")
    assert ready.status_code == 503 and ready.headers["Retry-After"].isdigit()
    health = await api.client.get("/health")
    assert (
        health.status_code == 200 and health.json()["engine"] == "restarting"
    )  # alive: no restart by the orchestrator
    held = asyncio.create_task(api.client.post(CHAT, json=chat_body(api.model)))
    await asyncio.sleep(0.05)
    assert not held.done()
    api.factory.gate.set()
    resp = await asyncio.wait_for(held, WAIT_S)
    assert resp.status_code == 200, resp.text
    assert (await api.client.get("/ready")).status_code == 200


async def test_hold_timeout_is_503_with_retry_after_for_streams_too(make_api: Callable[..., object]) -> None:
    api = await make_api("--guard-hold-timeout", "0.2")  # type: ignore[misc]
    assert isinstance(api, Api)
    api.factory.gate.clear()
    api.supervisor.report_death(api.supervisor.generation, DeathCause.PROCESS_EXIT)
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.RESTARTING), WAIT_S)
    for stream in (False, True):
        resp = await api.client.post(CHAT, json=chat_body(api.model, stream=stream))
        assert resp.status_code == 503 and resp.headers["Retry-After"].isdigit(), resp.text
        assert resp.json()["error"]["code"] == 503
    api.factory.gate.set()
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.READY), WAIT_S)


async def test_failed_supervisor_fails_liveness(make_api: Callable[..., object]) -> None:
    api = await make_api("--guard-restart-max", "0")  # type: ignore[misc]
    assert isinstance(api, Api)
    api.supervisor.report_death(api.supervisor.generation, DeathCause.PROCESS_EXIT)
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.FAILED), WAIT_S)
    health = await api.client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "failed", "engine": "failed"}
    resp = await api.client.post(CHAT, json=chat_body(api.model))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 503


async def test_engine_death_mid_request_is_invisible(api: Api) -> None:
    engine = api.engine
    engine.pause()
    seen = len(engine.requests)
    request = asyncio.create_task(api.client.post(CHAT, json=chat_body(api.model, max_tokens=4)))
    await asyncio.wait_for(engine.wait_for_requests(seen + 1), WAIT_S)
    engine.die()
    resp = await asyncio.wait_for(request, WAIT_S)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    assert api.supervisor.generation == 2


async def test_quarantined_request_is_400_in_the_envelope(make_api: Callable[..., object]) -> None:
    poison_word = "Xylophonequartzmarker"
    parts_api = await make_api("--guard-quarantine-deaths", "1")  # type: ignore[misc]
    assert isinstance(parts_api, Api)
    tokenizer = parts_api.engine.renderer.tokenizer
    poison = tuple(tokenizer.encode(" " + poison_word, add_special_tokens=False))
    api = await make_api("--guard-quarantine-deaths", "1", poison=poison)  # type: ignore[misc]
    assert isinstance(api, Api)
    body = chat_body(api.model, text=f"Report {poison_word} now.")
    resp = await api.client.post(CHAT, json=body)
    assert resp.status_code == 400, resp.text
    assert "quarantined" in resp.json()["error"]["message"]
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.READY), WAIT_S)  # the fault's rebuild
    again = await api.client.post(CHAT, json=body)
    assert again.status_code == 400 and api.supervisor.generation == 2  # refused without another death
    assert (await api.client.post(CHAT, json=chat_body(api.model))).status_code == 200


async def test_stream_that_cannot_be_resumed_ends_with_an_error_event(api: Api) -> None:
    """``n=2`` streams cannot be resumed on a new engine: after tokens were sent, a death ends the stream
    with an OpenAI error event (the 200 was already sent); a one-choice stream is resumed instead."""
    api.engine.die_after(3)
    resp = await api.client.post(CHAT, json=chat_body(api.model, stream=True, n=2, max_tokens=50))
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    assert "error" in events[-1] and "cannot be resumed" in str(events[-1]["error"]), events[-1]
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.READY), WAIT_S)
    assert api.supervisor.generation == 2
    api.engine.die_after(3)
    resp = await api.client.post(CHAT, json=chat_body(api.model, stream=True, max_tokens=6))
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    assert not any("error" in e for e in events) and resp.text.rstrip().endswith("data: [DONE]")
    assert api.supervisor.generation == 3


@pytest.mark.parametrize("route", [CHAT, "/v1/completions", "/v1/responses"])
async def test_a_stream_with_decoding_state_is_rerun_not_resumed(api: Api, route: str) -> None:
    """#35: a stream whose decoding has state a resumption would lose (here stop strings and a frequency
    penalty) is re-run on the new engine from its original prompt, and the client's stream goes on right
    after the tokens it already had: the same text as uninterrupted, nothing twice. Chat, completions and
    responses streams alike (one engine client serves every route)."""
    fields = {"stream": True, "max_tokens": 8, "temperature": 0, "frequency_penalty": 1.0, "stop": ["never"]}
    body = {
        CHAT: chat_body(api.model, **fields),
        "/v1/completions": {"model": api.model, "prompt": "Hello", **fields},
        "/v1/responses": {"model": api.model, "input": "Hello", "stream": True, "max_output_tokens": 8,
                          "temperature": 0, "frequency_penalty": 1.0, "stop": ["never"]},
    }[route]  # fmt: skip

    def content(text: str) -> str:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert not any("error" in e or e.get("type") == "error" for e in events), events
        if route == "/v1/responses":
            return "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
        choices = [e["choices"][0] for e in events if e["choices"]]
        return "".join((c["delta"].get("content") if "delta" in c else c["text"]) or "" for c in choices)

    reference = content((await api.client.post(route, json=body)).text)
    first = api.engine
    first.die_after(3)
    resp = await api.client.post(route, json=body)
    assert content(resp.text) == reference and reference.count(" t") == 8
    rerun = api.engine
    assert rerun is not first and rerun.prompts[rerun.requests[-1]] == first.prompts[first.requests[-1]]
    assert rerun.sampling[rerun.requests[-1]].max_tokens == 8  # the whole request again, not the rest


async def test_cors_preflight_as_vllm_serve(make_api: Callable[..., object]) -> None:
    api = await make_api("--allowed-origins", '["https://ui.example"]')  # type: ignore[misc]
    assert isinstance(api, Api)
    headers = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    resp = await api.client.options(CHAT, headers=headers)
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "https://ui.example"
    other = await api.client.options(CHAT, headers={**headers, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


async def test_operator_lists_and_clears_the_quarantine(make_api: Callable[..., object]) -> None:
    """#20: a quarantined fingerprint is listed, the gauge counts it, and clearing it serves it again;
    the admin routes need the API key."""
    key = {"Authorization": "Bearer k-1"}
    first = await make_api("--api-key", "k-1")  # type: ignore[misc]
    assert isinstance(first, Api)
    poison = tuple(first.engine.renderer.tokenizer.encode(" Xylophonequartzmarker", add_special_tokens=False))
    api = await make_api("--api-key", "k-1", "--guard-quarantine-deaths", "1", poison=poison)  # type: ignore[misc]
    assert isinstance(api, Api)
    body = chat_body(api.model, text="Report Xylophonequartzmarker now.")
    assert (await api.client.post(CHAT, json=body, headers=key)).status_code == 400
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.READY), WAIT_S)  # the fault's rebuild
    assert (await api.client.get("/admin/quarantine")).status_code == 401
    listed = (await api.client.get("/admin/quarantine", headers=key)).json()
    refused = [e for e in listed["entries"] if e["refused"]]
    assert len(refused) == 1 and refused[0]["strikes"] == 1
    assert "vlguard_quarantine_fingerprints 1.0" in (await api.client.get("/metrics")).text
    fp = refused[0]["fingerprint"]
    assert (await api.client.delete(f"/admin/quarantine/{fp}", headers=key)).json() == {"cleared": 1}
    assert "vlguard_quarantine_fingerprints 0.0" in (await api.client.get("/metrics")).text
    api.factory.poison = ()  # the fault is fixed (say, a driver upgrade): the request is served again
    api.supervisor.report_death(api.supervisor.generation, DeathCause.PROCESS_EXIT)  # READY -> DEAD at once
    await asyncio.wait_for(api.supervisor.states.wait_for(EngineState.READY), WAIT_S)
    served = await api.client.post(CHAT, json=body, headers=key)
    assert served.status_code == 200, served.text
    assert (await api.client.delete("/admin/quarantine", headers=key)).json()["cleared"] >= 0


async def test_admin_routes_trust_credentials_not_addresses(make_api: Callable[..., object]) -> None:
    """#34: without a key the admin routes are closed even to loopback (every client behind a proxy on
    the host is loopback), unless loopback is trusted explicitly; a request from a web page (Origin) is
    refused whatever it carries; the operator key opens them, and Authorization is read as on /v1."""
    import httpx

    closed: Api = await make_api()  # type: ignore[assignment]
    resp = await closed.client.get("/admin/quarantine")  # ASGITransport's client is 127.0.0.1
    assert resp.status_code == 403 and "--guard-operator-key" in resp.json()["error"]["message"]

    opted: Api = await make_api("--guard-admin-loopback", "on")  # type: ignore[assignment]
    assert (await opted.client.get("/admin/quarantine")).status_code == 200
    assert (await opted.client.get("/admin/quarantine", headers={"Origin": "http://evil.example"})).status_code == 403
    # #61: a page whose name was rebound to the loopback sends its own Host (and no Origin on a simple GET)
    for host in ("rebound.example", "rebound.example:8000", "127.0.0.1.nip.io"):
        resp = await opted.client.get("/admin/quarantine", headers={"Host": host})
        assert resp.status_code == 403 and "Host" in resp.json()["error"]["message"], (host, resp.text)
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert (await opted.client.get("/admin/quarantine", headers={"Host": host})).status_code == 200, host
    app = opted.client._transport.app  # type: ignore[attr-defined]
    remote = httpx.ASGITransport(app=app, client=("203.0.113.9", 5000))
    async with httpx.AsyncClient(transport=remote, base_url="http://vlguard.test") as client:
        resp = await client.delete("/admin/quarantine")
    assert resp.status_code == 403 and resp.json()["error"]["code"] == 403

    keyed: Api = await make_api("--api-key", "k-1", "--guard-operator-key", "op-7")  # type: ignore[assignment]
    assert (await keyed.client.get("/admin/quarantine", headers={"Authorization": "Bearer k-1"})).status_code == 401
    for header in ("Bearer op-7", "bearer op-7", "BEARER op-7"):  # as vLLM reads it on /v1
        assert (await keyed.client.get("/admin/quarantine", headers={"Authorization": header})).status_code == 200
    for header in ("op-7", "Bearer  op-7", "Token op-7"):  # the raw key is no longer accepted
        assert (await keyed.client.get("/admin/quarantine", headers={"Authorization": header})).status_code == 401
    hostile = {"Authorization": "Bearer op-7", "Origin": "http://rebound.example"}
    assert (await keyed.client.delete("/admin/quarantine", headers=hostile)).status_code == 403


async def test_a_stop_request_turns_ready_503_while_requests_are_still_served(make_api: Callable[..., object]) -> None:
    """SIGTERM (``request_stop``) under ``--guard-shutdown-delay``: /ready answers 503 at once, so a load
    balancer stops routing here, while a request that still arrives is served (the drain starts later)."""
    api: Api = await make_api()  # type: ignore[misc]
    api.supervisor.request_stop()
    await asyncio.sleep(0)  # request_stop schedules the flag on the loop, as from a signal handler
    ready = await api.client.get("/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False and ready.headers["Retry-After"].isdigit()
    assert (await api.client.get("/health")).status_code == 200  # alive: liveness must not restart it
    assert (await api.client.post(CHAT, json=chat_body(api.model))).status_code == 200
