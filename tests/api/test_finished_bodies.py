"""What a finished request's body leaves behind is bounded (:mod:`server.api.garbage`): vLLM's request
models keep a parsed body in a reference cycle (pydantic's ``ValidatorIterator``) that only a full
garbage collection frees, and CPython starts those by object counts, not bytes. In-process, with the
collector's automatic runs turned off for the test, so that only what the server does is seen."""

from __future__ import annotations

import base64
import gc
import io
import math
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from tests.helpers import chat_body
from tests.inprocess import Api

BUDGET_MIB = 16  # --guard-max-body-memory-mb: a collection after each 4 MiB of finished bodies
REQUESTS = 6


def _corrupt_png_uri() -> str:
    """A ~3 MiB PNG (noise, stored uncompressed) whose pixel data fails its checksum: refused with a 400
    where vLLM loads it, after vLLM's request model has parsed the body (~4 MiB as a data URI)."""
    pixels = np.random.default_rng(0).integers(0, 255, (1000, 1000, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=0)
    data = bytearray(buf.getvalue())
    data[data.find(b"IDAT") + 5000] ^= 0xFF
    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode()


def _cyclic_garbage_bytes() -> int:
    """Bytes of the strings and bytes that unreachable reference cycles hold now (freed by this call)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        held = {
            id(value): len(value)
            for cycle_member in gc.garbage
            for value in gc.get_referents(cycle_member)
            if isinstance(value, (str, bytes, bytearray))
        }
        return sum(held.values())
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    """The collector's automatic runs off for the test (on again after it), starting from no garbage."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _send_refused_images(client: httpx.AsyncClient, model: str) -> int:
    """:data:`REQUESTS` requests, one after the other, each with the corrupt image; returns the body size."""
    body = chat_body(model, _corrupt_png_uri())
    for _ in range(REQUESTS):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert "not a readable image" in response.json()["error"]["message"]
    return len(body["messages"][0]["content"][1]["image_url"]["url"])


async def test_vllm_keeps_a_finished_requests_body_in_a_reference_cycle(
    make_api, no_automatic_collection: None
) -> None:
    """Upstream (vLLM's app alone, without vlguard's layers): the finished requests' parsed bodies are
    still held, by cycles, until a full collection (every one but the latest, which may still be
    reachable). If this fails, the cycle is gone and
    :mod:`server.api.garbage` may go too."""
    api: Api = await make_api("--guard-max-body-memory-mb", str(BUDGET_MIB))
    vllm_app = api.app.router.default.app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=vllm_app), base_url="http://vllm") as client:
        size = await _send_refused_images(client, api.model)
    held = _cyclic_garbage_bytes()
    assert held >= (REQUESTS - 1) * size, f"{held} bytes in cycles after {REQUESTS} bodies of {size}"


async def test_finished_bodies_leave_at_most_a_quarter_of_the_budget_behind(
    make_api, no_automatic_collection: None
) -> None:
    """Through vlguard, the same requests: a full collection after each quarter of the body budget in
    finished bodies, so the cycles hold less than a quarter of it (each body once)."""
    api: Api = await make_api("--guard-max-body-memory-mb", str(BUDGET_MIB))
    before = REGISTRY.get_sample_value("vlguard_body_gc_collections_total") or 0.0
    size = await _send_refused_images(api.client, api.model)
    collections = (REGISTRY.get_sample_value("vlguard_body_gc_collections_total") or 0.0) - before
    held = _cyclic_garbage_bytes()
    quarter = BUDGET_MIB * 1024 * 1024 // 4
    assert collections == REQUESTS // math.ceil(quarter / size), collections  # each run frees all before it
    assert held < quarter + size, f"{held} bytes in cycles after {REQUESTS} bodies of {size} ({collections:g} runs)"
