"""Distinct structured-output constraints do not grow the engine core (``server.engine.grammar_cache``):
xgrammar's cache of compiled grammars is bounded by VLLM_XGRAMMAR_CACHE_MB, the process was not. Measured
on this lane before the fix: 300 distinct 3 KB regexes, one request each, grew the engine core's processes
by 585 MB (2936 -> 3521), and 700 by 1.1 GB; after it, 200 grew them by 6 MB. On the session's shared
server."""

from __future__ import annotations

import secrets

import httpx

from tests.helpers import engine_core
from tests.servers import ServerProcess

WARM, MEASURED = 10, 60
BOUND_MIB = 30  # before the fix, 60 requests grew the engine core by ~100 MiB


def _engine_rss(srv: ServerProcess) -> int:
    core = engine_core(srv)
    return sum(p.memory_info().rss for p in [core, *core.children(recursive=True)] if p.is_running())


def test_distinct_constraints_do_not_grow_the_engine_core(server: ServerProcess, model_name: str) -> None:
    def one(client: httpx.Client) -> None:
        regex = secrets.token_hex(8) + "x" * 3000  # distinct: each is compiled
        body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "structured_outputs": {"regex": regex}}  # fmt: skip
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text[:300]

    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(WARM):
            one(client)
        before = _engine_rss(server)
        for _ in range(MEASURED):
            one(client)
        grown = _engine_rss(server) - before
    print(f"engine core after {MEASURED} distinct constraints: {grown / 2**20:+.1f} MiB")
    assert grown < BOUND_MIB * 2**20, f"{MEASURED} distinct constraints grew the engine core by {grown >> 20} MiB"
