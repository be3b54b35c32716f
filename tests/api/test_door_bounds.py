"""Bounds before work (#34): media items counted against vLLM's per-prompt limit before anything is
decoded or fetched; pixel work only in the decode pool where vLLM loads images, within its pixel budget,
while other requests go on; remote fetches cancelled together on the first failure; a malformed URL is a
400 without a traceback. In-process (vlguard's own layer over vLLM's real serving layer; the tiny profile allows 4
images and no video per prompt)."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import httpx
import pytest

from server.workload.images import data_uri, photo_uri
from tests.helpers import chat_body, http_host, png
from tests.inprocess import Api

WAIT_S = 20
#: A 16-bit PNG, which normalisation scales to 8 bits on every lane: ~0.9 s of decoding each, 31 KB encoded.
DEEP = data_uri(png(4000, 4000, "I;16"), "image/png")
PIXELS = 4000 * 4000


class _DecodeSpy:
    """Wraps the media policy's decode pool (where vLLM loads images): records every job, the jobs done,
    and the most decodes running at once (counted on the pool's threads)."""

    def __init__(self, api: Api) -> None:
        self.pool = api.app.state.media.decoder
        self.started: list[int] = []  # one entry a job (waiting or decoding)
        self.done: list[int] = []
        self.running = self.most_running = 0
        lock = threading.Lock()
        run = self.pool.run

        def counted(fn: Callable[..., Any], *args: object) -> Any:
            with lock:
                self.running += 1
                self.most_running = max(self.most_running, self.running)
            try:
                return fn(*args)
            finally:
                with lock:
                    self.running -= 1

        async def spied(pixels: int, fn: Callable[..., Any], *args: object, **kwargs: Any) -> Any:
            self.started.append(pixels)
            try:
                return await run(pixels, counted, fn, *args, **kwargs)
            finally:
                self.done.append(pixels)

        self.pool.run = spied

    @property
    def jobs(self) -> int:
        return len(self.started)

    @property
    def finished(self) -> int:
        return len(self.done)

    def busy(self) -> bool:
        return self.pool.free < self.pool.max_pixels


async def test_more_items_than_the_per_prompt_limit_are_refused_before_any_decoding(api: Api) -> None:
    """Ten transparent 7000x7000 PNGs in one request took 16.8 s and +956 MB to get the 400 stock gives at
    once: now the count comes first, and no pixel is decoded."""
    assert (await api.client.get("/health")).status_code == 200
    spy = _DecodeSpy(api)
    body = chat_body(api.model, *[DEEP] * 10)
    started = time.monotonic()
    resp = await api.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert "At most 4 image(s) may be provided in one prompt; this request has 10" in resp.json()["error"]["message"]
    assert time.monotonic() - started < 1.0 and spy.jobs == 0
    # An untyped video part counts, as vLLM's parser reads it (the profile allows no video).
    untyped = {"model": api.model, "messages": [{"role": "user", "content": [{"video_url": {"url": "data:v"}}]}]}
    resp = await api.client.post("/v1/chat/completions", json=untyped)
    assert resp.status_code == 400 and "At most 0 video(s)" in resp.json()["error"]["message"]
    tokenize = {"model": api.model, "messages": body["messages"]}
    resp = await api.client.post("/tokenize", json=tokenize)  # the second way in: the same count
    assert resp.status_code == 400 and "At most 4 image(s)" in resp.json()["error"]["message"] and spy.jobs == 0


def _client_at(api: Api, host: str) -> httpx.AsyncClient:
    """A client of ``api`` from ``host`` (not loopback: loopback clients share one identity)."""
    transport = httpx.ASGITransport(app=api.app, client=(host, 40000), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://vlguard.test", timeout=60)


async def test_pixel_work_stays_within_the_budget_while_other_requests_go_on(make_api: Callable[..., Any]) -> None:
    """One client's three requests of four 16-bit 16-megapixel images each, with a budget of two such
    images decoding at once: the budget holds; another client's plain image is answered before the first of
    them is done (the ten waiting hold none of vLLM's eight media loading threads: when they did, it waited
    behind six); its small 16-bit image, which needs the pool too, takes its turn after about one more of
    them (first come, first served, it waited for all twelve)."""
    api: Api = await make_api(
        "--guard-max-image-pixels", str(PIXELS), "--guard-decode-pixels", str(2 * PIXELS), "--guard-decode-threads", "4"
    )  # four threads: the pixel budget is what bounds the decodes at once
    assert (await api.client.get("/health")).status_code == 200
    spy = _DecodeSpy(api)
    async with _client_at(api, "192.0.2.1") as hostile, _client_at(api, "192.0.2.2") as other:
        heavy = [
            asyncio.create_task(hostile.post("/v1/chat/completions", json=chat_body(api.model, *[DEEP] * 4)))
            for _ in range(3)
        ]
        deadline = time.monotonic() + WAIT_S
        while spy.jobs < 12:  # every image read and waiting for the pool or decoding
            answered = [t.result().text[:200] for t in heavy if t.done()]
            assert time.monotonic() < deadline, f"{spy.jobs} of 12 images reached the decode pool; {answered}"
            await asyncio.sleep(0.01)
        for image, most_done in ((png(64, 48), 0), (png(64, 48, "I;16"), 4)):
            light = asyncio.create_task(
                other.post("/v1/chat/completions", json=chat_body(api.model, data_uri(image, "image/png"), text="Hi"))
            )
            assert (await light).status_code == 200
            assert spy.finished <= most_done, f"the image request waited for {spy.finished} normalisations"
        for resp in await asyncio.wait_for(asyncio.gather(*heavy), 4 * WAIT_S):
            assert resp.status_code == 200, resp.text
    assert spy.jobs == 13 and spy.most_running == 2 and not spy.busy()


class _Drip(http.server.BaseHTTPRequestHandler):
    """A media host: ``/drip.png`` sends a PNG a little at a time over ~2 s and records whether the client
    read it all or went away; every request is counted."""

    hits: ClassVar[list[str]] = []
    outcomes: ClassVar[list[str]] = []
    done = threading.Semaphore(0)

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.hits.append(self.path)
        if self.path != "/drip.png":
            time.sleep(0.3)  # a late failure: the downloads beside it have started
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = png(64, 64)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body) + 40 * 1024))
        self.end_headers()
        try:
            for _ in range(40):
                self.wfile.write(b"\0" * 1024)
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(body)
            self.outcomes.append("completed")
        except OSError:
            self.outcomes.append("cancelled")
        finally:
            self.done.release()


@pytest.fixture(scope="module")
def drip_host() -> Iterator[str]:
    with http_host(_Drip) as url:
        yield url


async def test_remote_fetches_are_counted_first_and_cancelled_together(
    make_api: Callable[..., Any], drip_host: str, caplog: pytest.LogCaptureFixture
) -> None:
    api: Api = await make_api("--guard-remote-media", "on", "--allowed-media-domains", "127.0.0.1")
    _Drip.hits.clear()
    _Drip.outcomes.clear()
    resp = await api.client.post("/v1/chat/completions", json=chat_body(api.model, *[drip_host + "/drip.png"] * 5))
    assert resp.status_code == 400 and "At most 4 image(s)" in resp.text and _Drip.hits == []  # nothing fetched

    # Three slow downloads and one that fails: the 400 comes with the failure and the downloads stop.
    body = chat_body(api.model, *[drip_host + "/drip.png"] * 3, drip_host + "/missing.png")
    started = time.monotonic()
    resp = await api.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400 and "HTTP 404" in resp.text
    assert time.monotonic() - started < 1.5 and _Drip.hits.count("/drip.png") == 3
    for _ in range(3):  # every download has ended, one way or the other
        assert await asyncio.to_thread(_Drip.done.acquire, timeout=WAIT_S)
    assert _Drip.outcomes and set(_Drip.outcomes) == {"cancelled"}, _Drip.outcomes

    # A URL that cannot be parsed is the client's own 400, with no traceback in the server's log.
    caplog.set_level(logging.INFO)
    for url in ("http://[::1/x.png", "http://127.0.0.1:99999/x.png"):
        resp = await api.client.post("/v1/chat/completions", json=chat_body(api.model, url))
        assert resp.status_code == 400 and "malformed URL" in resp.json()["error"]["message"], resp.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    good = chat_body(api.model, photo_uri("astronaut.png"))
    assert (await api.client.post("/v1/chat/completions", json=good)).status_code == 200


async def test_a_prompt_far_beyond_the_context_is_refused_before_it_is_tokenized(api: Api) -> None:
    """#44: a 30 MB prompt ran vLLM's tokenizer for 46-66 s (one thread: every generation waited behind it).
    Text longer than max_model_len tokens of the longest token's length cannot fit: refused at the door, on
    /tokenize and the generation routes alike, at once."""
    import time

    rules = api.app.state.poison_rules
    assert rules.max_prompt_chars is not None
    text = "a" * (rules.max_prompt_chars + 1)
    for path, body in (
        ("/tokenize", {"model": api.model, "prompt": text}),
        ("/v1/completions", {"model": api.model, "prompt": [text], "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": api.model, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
        ),
        ("/v1/responses", {"model": api.model, "input": text}),
    ):
        started = time.monotonic()
        resp = await api.client.post(path, json=body)
        assert resp.status_code == 400 and "cannot fit the model's context" in resp.json()["error"]["message"], path
        assert time.monotonic() - started < 1.0, path
    fits = {"model": api.model, "prompt": "a" * 1000}
    assert (await api.client.post("/tokenize", json=fits)).status_code == 200


async def test_every_text_the_template_reads_counts_toward_the_prompt_bound(api: Api) -> None:
    """#61: an 8 MB ``role`` on /tokenize took 45 s and delayed another client's chat as long; tool
    definitions, names and template arguments are the same kind. Every string under the input fields counts,
    media excepted; each refused at once while another request is served."""
    text = "a" * (api.app.state.poison_rules.max_prompt_chars + 1)
    chat = {"model": api.model, "max_tokens": 1}
    tool = {"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}
    url_property = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"url": {"x": text}}}}}
    cases = {
        "role": ("/tokenize", {"model": api.model, "messages": [{"role": text, "content": "hi"}]}),
        "name": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "name": text, "content": "hi"}]}),
        "tool": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}),
        "template argument": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template_kwargs": {"x": text}}),
        # hostile review: text that starts like a data URI, a tool property named like media, a key
        "data: text": ("/tokenize", {"model": api.model, "prompt": "data:" + text}),
        "property url": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}],
                                                  "tools": [url_property]}),
        "key": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}],
                                         "chat_template_kwargs": {text: 1}}),
    }  # fmt: skip
    for case, (path, body) in cases.items():
        started = time.monotonic()
        other = asyncio.create_task(api.client.post("/v1/chat/completions", json=chat_body(api.model)))
        resp = await api.client.post(path, json=body)
        assert resp.status_code == 400 and "cannot fit the model's context" in resp.text, (case, resp.text[:300])
        assert time.monotonic() - started < 1.0 and (await other).status_code == 200, case
    image = {"type": "image_url", "image_url": {"url": DEEP}}  # media is not text: bounded as media
    resp = await api.client.post(
        "/tokenize", json={"model": api.model, "messages": [{"role": "user", "content": [image]}]}
    )
    assert "cannot fit" not in resp.text, resp.text[:300]


FIELDS = {
    "stop": ["x"] * 2000,
    "bad_words": ["word"] * 2000,
    "logit_bias": {str(i): 1 for i in range(2000)},
    "allowed_token_ids": list(range(2000)),
    "structured_outputs": {"choice": [f"c{i}" for i in range(2000)]},
    "vllm_xargs": {"k": "v" * 70_000},
    "an_unknown_field": "u" * 70_000,
    "model": "m" * 5_000_000,
}


@pytest.mark.parametrize("field", FIELDS)
async def test_fields_beside_the_input_are_bounded_before_vllm_reads_them(api: Api, field: str) -> None:
    """#61: 500,000 ``bad_words`` held /health 29 s, 900,000 ``stop`` strings 17 s: vLLM works through them
    item by item. Any list or object beside the input holds at most 1024 items, and those fields at most
    64 KiB of text together: 400 naming the field, at once, while /health answers."""
    body = {**chat_body(api.model), field: FIELDS[field]}
    started = time.monotonic()
    health = asyncio.create_task(api.client.get("/health"))
    resp = await api.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith(field), resp.text[:300]
    assert time.monotonic() - started < 2.0 and (await health).status_code == 200
    within = {**chat_body(api.model), "stop": ["x", "y"], "logit_bias": {"1": 1}}  # vLLM 0.34: at most 4 stops
    assert (await api.client.post("/v1/chat/completions", json=within)).status_code == 200


async def test_a_responses_output_format_is_bounded_as_a_field(api: Api) -> None:
    """Hostile review: a top-level ``text`` (the Responses output format) was taken for input and escaped the
    field bounds: a JSON schema with a 100,000-item enum kept the engine core busy 31 s."""
    schema = {"type": "object", "properties": {"a": {"enum": [0.5, *range(2000)]}}, "required": ["a"]}
    body = {"model": api.model, "input": "hi", "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}  # fmt: skip
    resp = await api.client.post("/v1/responses", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("text: "), resp.text[:300]


async def test_a_prompt_of_more_token_ids_than_the_context_is_refused_before_it_is_validated(api: Api) -> None:
    """Hostile review: 990,000 token ids to /v1/completions held the event loop 133 ms in vLLM's request
    validation before its own 400. A prompt of token ids (alone, or one of a batch) longer than
    max_model_len (4096 in the tiny profile) is refused at the door, on every route that takes one."""
    ids = [1] * 4097
    for path, body in (
        ("/v1/completions", {"model": api.model, "prompt": ids, "max_tokens": 1}),
        ("/v1/completions", {"model": api.model, "prompt": [[1, 2], ids], "max_tokens": 1}),
        ("/tokenize", {"model": api.model, "prompt": ids}),
    ):
        resp = await api.client.post(path, json=body)
        assert resp.status_code == 400 and "4097 token ids cannot fit" in resp.json()["error"]["message"], path
    fits = {"model": api.model, "prompt": [1] * 4000, "max_tokens": 1}
    resp = await api.client.post("/v1/completions", json=fits)
    assert "token ids cannot fit" not in resp.text, resp.text[:300]


async def test_a_body_of_too_many_values_is_refused_before_it_is_parsed(api: Api) -> None:
    body = b'{"model": "m", "messages": [], "unused": [' + b"0," * 1_000_001 + b"0]}"
    resp = await api.client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "JSON values" in resp.json()["error"]["message"]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_constants_are_refused_while_parsing(api: Api, constant: str) -> None:
    body = f'{{"model": "{api.model}", "prompt": "hi", "max_tokens": 1, "temperature": {constant}}}'.encode()
    resp = await api.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "not a finite JSON number" in resp.json()["error"]["message"]


@pytest.mark.full_only  # vlguard's own door, whatever the vLLM; 130 MB of bodies: the default lane runs it
async def test_huge_bodies_never_hold_the_event_loop(api: Api) -> None:
    """#44: a 47-57 MB body held the event loop 10-18 s (/health waited that long), 12 s of it the door's own
    walk; a 30 MB /tokenize prompt ran the tokenizer 46-66 s. With both in flight, /health answers within 1.5 s
    each time (the door counts values before parsing, parses and checks large bodies off the loop, and
    refuses text that cannot fit before tokenizing it). So with bodies of many small objects (450,000 empty
    messages, 100,000 tools), which vLLM validated on the event loop for 1.5-5 s: refused by their count."""
    # Encoded before the clock starts: the client shares the event loop in-process, its own work is not the server's.
    numbers = b'{"model": "m", "messages": [], "unused": [' + b"1," * 25_000_000 + b"1]}"
    text = json.dumps({"model": api.model, "prompt": "word " * 6_000_000}).encode()  # 30 MB
    big_string = json.dumps({"model": api.model, "prompt": "hi", "max_tokens": 1, "user": "x" * 50_000_000}).encode()
    # Many small objects, under the value bound: vLLM validated them on the event loop (/health waited 5 s)
    messages = json.dumps({"model": api.model, "messages": [{"role": "user", "content": ""}] * 450_000}).encode()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools = json.dumps({"model": api.model, "messages": [{"role": "user", "content": "hi"}], "tools": [tool] * 100_000})
    json_headers = {"content-type": "application/json"}
    bodies = (("/v1/chat/completions", numbers), ("/tokenize", text), ("/v1/completions", big_string),
              ("/tokenize", messages), ("/v1/chat/completions", tools.encode()))  # fmt: skip
    heavy = [
        asyncio.create_task(api.client.post(path, content=content, headers=json_headers)) for path, content in bodies
    ]
    worst = 0.0
    while not all(task.done() for task in heavy):
        started = time.monotonic()
        assert (await api.client.get("/health")).status_code == 200
        worst = max(worst, time.monotonic() - started)
        await asyncio.sleep(0.05)
    statuses = [(await task).status_code for task in heavy]
    assert statuses[:2] == [413, 400], statuses
    assert statuses[2] < 500 and statuses[3:] == [413, 413], statuses
    # Standalone /health waits 0.54-0.58 s at worst here, 1.03 s once late in a full suite (CI): pydantic's
    # parse of a 15-50 MB body in the door's thread holds the GIL throughout (vLLM's route takes the door's
    # parse of the 50 MB body it lets through). The bound guards against the 10-18 s this test was written for.
    assert worst < 1.5, f"/health waited {worst:.2f} s"


async def test_one_request_asks_for_a_bounded_number_of_sequences(api: Api) -> None:
    """``--guard-max-sequences`` (16): ``n``, ``best_of`` and a completions batch count; a token-id prompt
    is one prompt. More is 400 before vLLM sees it, at most is served."""
    chat = {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    refused = await api.client.post("/v1/chat/completions", json={**chat, "n": 17})
    assert refused.status_code == 400 and "17 sequences" in refused.json()["error"]["message"], refused.text
    assert (await api.client.post("/v1/chat/completions", json={**chat, "n": 16})).status_code == 200
    completion = {"model": api.model, "max_tokens": 1}
    for prompt, n, status in ((["hi"] * 17, 1, 400), (["hi"] * 8, 2, 200), (["hi"] * 8, 3, 400),
                              ([[1, 2]] * 17, 1, 400), (list(range(100, 140)), 1, 200), ("hi", 17, 400)):  # fmt: skip
        resp = await api.client.post("/v1/completions", json={**completion, "prompt": prompt, "n": n})
        assert resp.status_code == status, (prompt[:2], n, resp.text[:200])
    best_of = await api.client.post("/v1/completions", json={**completion, "prompt": "hi", "best_of": 20})
    assert best_of.status_code == 400


async def test_a_body_of_too_many_objects_is_refused_before_vllm_parses_it(api: Api) -> None:
    many = {"model": api.model, "max_tokens": 1, "messages": [{"role": "user", "content": ""}] * 10_001}
    resp = await api.client.post("/v1/chat/completions", json=many)
    assert resp.status_code == 413 and "10000 JSON objects" in resp.json()["error"]["message"], resp.text[:300]
    fine = {**many, "messages": [{"role": "user", "content": "hi"}] * 50}
    assert (await api.client.post("/v1/chat/completions", json=fine)).status_code == 200


async def test_a_refusal_of_many_bad_items_names_twenty_errors(api: Api) -> None:
    """vLLM's validation of 300 bad items against its union of Responses input items gives ~60 errors an
    item: the 400 names 20 and counts the rest (it was a 30 MB message; the validation itself is vLLM's,
    and stock's, cost: docs/input.md)."""
    refused = await api.client.post("/v1/responses", json={"model": api.model, "input": [None] * 300})
    assert refused.status_code == 400 and len(refused.content) < 20_000, len(refused.content)
    message = refused.json()["error"]["message"]
    assert message.startswith("input.") and message.endswith("more errors)"), message[-200:]
