"""The bench's phase tracer (server/workload/phase_trace.py) and its report, on fakes of the traced points
(the real points are traced in both real servers by ``vlguard bench compare``; its test checks the table)."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from server.workload import phase_trace, report
from server.workload.generator import Record


@pytest.fixture
def sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "trace.jsonl"
    with path.open("a", buffering=1, encoding="utf-8") as file:
        monkeypatch.setattr(phase_trace, "_sink", file)
        monkeypatch.setattr(phase_trace, "_pending", [])
        yield path


def test_trace_ids_are_found_in_vllm_request_ids_headers_and_asgi_scopes() -> None:
    rid = phase_trace.trace_id()

    class Request:
        def __init__(self) -> None:
            self.headers = {"x-request-id": rid}

    assert phase_trace.request_id_of(f"chatcmpl-{rid}-0a1b2c3d") == rid
    assert phase_trace.request_id_of("model", Request()) == rid
    assert phase_trace.request_id_of({"type": "http", "headers": [(b"x-request-id", rid.encode())]}) == rid
    assert phase_trace.request_id_of("chatcmpl-abc", {"headers": []}, object()) is None


async def test_the_asgi_point_and_the_first_content_body_sent_are_stamped_once(sink: Path) -> None:
    rid = phase_trace.trace_id()
    bodies = [b'data: {"delta":{"role":"assistant","content":""}}', b'data: {"delta":{"content":"Hi"}}', b"x"]

    seen = []

    async def app(_self: Any, scope: Any, receive: Any, send: Any) -> None:
        seen.append(phase_trace._current.get())
        await send({"type": "http.response.start", "status": 200})
        for body in [*bodies, bodies[1]]:
            await send({"type": "http.response.body", "body": body, "more_body": True})

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": [(b"x-request-id", rid.encode())]}
    await phase_trace._traced_asgi(app)(None, scope, None, send)
    await phase_trace._traced_asgi(app)(None, {"type": "http", "headers": []}, None, send)  # untraced
    events = phase_trace.read(sink)
    assert list(events) == [rid] and list(events[rid]) == ["asgi", "sent"]
    assert len(sent) == 10 and phase_trace._current.get() is None
    assert seen == [rid, ""]  # what the app awaits sees the request's id, or that it carries none


async def test_a_traced_requests_points_are_written_before_its_last_body_is_handed_on(sink: Path) -> None:
    rid = phase_trace.trace_id()
    written_at_end: list[str] = []

    def written() -> str:
        return sink.read_text()

    async def app(_self: Any, scope: Any, receive: Any, send: Any) -> None:
        phase_trace.stamp(rid, "handler")
        await send({"type": "http.response.body", "body": b'data: {"content":"a"}', "more_body": True})
        assert written() == ""  # noted in memory while the request runs
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(message: Any) -> None:
        if not message.get("more_body", False):
            written_at_end.append(written())

    scope = {"type": "http", "headers": [(b"x-request-id", rid.encode())]}
    await phase_trace._traced_asgi(app)(None, scope, None, send)
    assert written_at_end and list(phase_trace.read(sink)[rid]) == ["asgi", "handler", "sent"]
    assert [line.count(rid) for line in written_at_end[0].splitlines()] == [1, 1, 1]


async def test_a_stream_stamps_its_start_and_first_matching_item_and_closes_the_wrapped_one(sink: Path) -> None:
    rid = phase_trace.trace_id()
    closed = []

    async def generate(_self: Any, prompt: str, params: Any, request_id: str) -> AsyncIterator[str]:
        try:
            for chunk in ('data: {"content":""}', 'data: {"content":"a"}', 'data: {"content":"b"}'):
                yield chunk
        finally:
            closed.append(request_id)

    traced = phase_trace._traced_stream("submit", "chunk", phase_trace._has_content)(generate)
    items = traced(None, "prompt", None, f"chatcmpl-{rid}")
    assert [await anext(items), await anext(items)] == ['data: {"content":""}', 'data: {"content":"a"}']
    await items.aclose()  # the client went away: the wrapped stream is closed too (vLLM aborts there)
    assert closed == [f"chatcmpl-{rid}"]
    phase_trace.flush()
    assert list(phase_trace.read(sink)[rid]) == ["submit", "chunk"]
    untraced = traced(None, "prompt", None, "chatcmpl-abc")
    assert untraced.ag_code is generate.__code__  # the stream itself: no step of the wrapper's per item
    await untraced.aclose()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


async def test_an_app_inside_a_served_request_and_points_inside_an_untraced_one_pass_at_once(sink: Path) -> None:
    """vlguard's shell hands a request on to vLLM's app: only the outer app is a point (its "sent" is
    where the HTTP server gets the body); inside an untraced request no point reads its arguments."""
    rid = phase_trace.trace_id()
    inner_sends: list[Any] = []

    async def inner(_self: Any, scope: Any, receive: Any, send: Any) -> None:
        inner_sends.append(send)
        await send({"type": "http.response.body", "body": b'data: {"content":"a"}', "more_body": False})

    traced_inner = phase_trace._traced_asgi(inner)

    async def outer(_self: Any, scope: Any, receive: Any, send: Any) -> None:
        await traced_inner(None, scope, receive, send)

    async def send(message: Any) -> None:
        return None

    scope = {"type": "http", "headers": [(b"x-request-id", rid.encode())]}
    await phase_trace._traced_asgi(outer)(None, scope, None, send)
    assert list(phase_trace.read(sink)[rid]) == ["asgi", "sent"] and len(inner_sends) == 1
    assert _lines(sink) == 2  # each noted once: the inner app is no point of its own

    read: list[Any] = []

    async def untraced_app(_self: Any, scope: Any, receive: Any, send: Any) -> None:
        class Request:
            @property
            def headers(self) -> dict[str, str]:
                read.append("headers")
                return {"x-request-id": phase_trace.trace_id()}

        assert phase_trace._args_id((None, Request()), {}, from_context=True) is None

    await phase_trace._traced_asgi(untraced_app)(None, {"type": "http", "headers": []}, None, send)
    assert read == []  # nothing was read to find an id


async def test_a_call_finds_the_id_of_the_request_it_serves_through_the_context(sink: Path) -> None:
    rid = phase_trace.trace_id()

    async def render(_self: Any, request: Any) -> str:
        return "rendered"

    async def generate(_self: Any, prompt: str, request_id: str) -> str:
        return "generated"

    token = phase_trace._current.set(rid)
    try:
        assert await phase_trace._traced_call(None, "rendered", from_context=True)(render)(None, object()) == "rendered"
        # a call that carries a request of its own (a probe started inside a traced request) is not credited
        assert await phase_trace._traced_call("submit", None)(generate)(None, "p", "vlguard-probe-1") == "generated"
    finally:
        phase_trace._current.reset(token)
    phase_trace.flush()
    assert list(phase_trace.read(sink)[rid]) == ["rendered"]


def test_install_wraps_the_points_it_finds_as_expected_and_skips_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Serving:
        async def handle(self, request: Any) -> str:
            return "handled"

        def render(self, request: Any) -> str:  # a point vLLM made synchronous: wrapping it would break it
            return "rendered"

    module = types.ModuleType("fake_serving")
    module.Serving = Serving  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_serving", module)
    points = (
        phase_trace._Point("fake_serving", "Serving", "handle", False, phase_trace._traced_call("handler", None)),
        phase_trace._Point("fake_serving", "Serving", "render", False, phase_trace._traced_call(None, "rendered")),
        phase_trace._Point("fake_serving", "Serving", "gone", False, phase_trace._traced_call("gone", None)),
        phase_trace._Point(
            "no_such_module_here", "X", "y", True, phase_trace._traced_stream("a", "b", phase_trace._any)
        ),
    )
    monkeypatch.setattr(phase_trace, "_POINTS", points)
    monkeypatch.setattr(phase_trace, "_GUARD_POINTS", ())  # nothing real wrapped in the test process
    monkeypatch.setattr(phase_trace, "_sink", None)
    monkeypatch.setattr(phase_trace, "_pending", [])
    path = tmp_path / "t.jsonl"
    try:
        assert phase_trace.install(str(path)) == ["fake_serving.Serving.handle"]  # the others skipped
        assert phase_trace.install(str(path)) == []  # idempotent: nothing wrapped twice
        assert Serving().render(None) == "rendered"  # left as it was
        rid = phase_trace.trace_id()

        class Request:
            headers = {"x-request-id": rid}  # noqa: RUF012

        assert asyncio.run(Serving().handle(Request())) == "handled"
    finally:
        phase_trace.flush()
        assert phase_trace._sink is not None
        phase_trace._sink.close()
    assert list(phase_trace.read(path)[rid]) == ["handler"]


def test_the_plugin_installs_in_the_api_process_when_its_variable_names_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    installed: list[str] = []
    monkeypatch.setattr(phase_trace, "install", lambda path: installed.append(path) or [])
    monkeypatch.setenv(phase_trace.ENV, str(tmp_path / "t.jsonl"))
    phase_trace.register()  # pytest's process has no multiprocessing parent, as a server's API process
    assert installed == [str(tmp_path / "t.jsonl")]


def test_the_plugin_is_inert_without_its_variable_and_outside_the_api_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    installed: list[str] = []
    monkeypatch.setattr(phase_trace, "install", lambda path: installed.append(path) or [])
    monkeypatch.delenv(phase_trace.ENV, raising=False)
    phase_trace.register()
    monkeypatch.setenv(phase_trace.ENV, str(tmp_path / "t.jsonl"))
    monkeypatch.setattr(phase_trace.multiprocessing, "parent_process", lambda: object())  # an engine process
    phase_trace.register()
    assert installed == []


def test_phases_add_up_to_the_client_ttft_and_the_guard_points_split_its_phases() -> None:
    points = ("asgi", "handler", "rendered", "guard", "submit", "output", "guard_out", "chunk", "sent")
    events = {"phase-1": {p: 100.0 + 0.010 * i for i, p in enumerate(points, start=1)}}
    rec = Record(0, "primary", True, 0.0, 0.2, ttft_s=0.1, ok=True, trace_id="phase-1", sent_at=100.0)
    unstreamed = Record(0, "rescue", False, 0.0, 0.2, ok=True, trace_id="phase-1", sent_at=100.0)
    phases = report.trace_phases_ms([rec, unstreamed], events)
    assert [name for name, _, _ in report.TRACE_PHASES] == list(phases)[: len(report.TRACE_PHASES)]
    assert sum(phases[name]["p50"] for name, _, _ in report.TRACE_PHASES) == pytest.approx(100.0)
    assert phases["submit"]["p50"] == pytest.approx(20.0)
    assert phases["submit: vlguard's client"]["p50"] == pytest.approx(10.0)
    assert phases["deliver"] == {"p50": pytest.approx(10.0), "mean": pytest.approx(10.0), "n": 1}
    stock = {"phase-1": {p: t for p, t in events["phase-1"].items() if p not in ("guard", "guard_out")}}
    assert "submit: vlguard's client" not in report.trace_phases_ms([rec], stock)


def test_the_table_sums_vlguards_own_phases_for_the_side_that_has_them() -> None:
    from server.workload.cli import trace_table

    own = {name: {"p50": 0.25, "mean": 0.5, "n": 3} for name in report.GUARD_OWN_PHASES}
    stock = {"connect": {"p50": 1.0, "mean": 1.0, "n": 3}}
    lines = trace_table("vlguard", "stock", {**stock, **own}, stock).splitlines()
    assert lines[1].split()[:4] == ["connect", "1.00", "1.00", "+0.00"]
    assert lines[-1].startswith("vlguard's own code on the way to the first token: 0.75 ms")
    assert not [line for line in lines if line.startswith("stock's own")]


def test_vlguards_own_phases_cpu_is_the_stamping_threads_cpu_between_their_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each point carries its thread's CPU time: a phase's CPU leaves out the time it waited (for the GIL,
    under load), and is given only where one thread stamped both of its points."""
    path = tmp_path / "trace.jsonl"
    with path.open("a", encoding="utf-8") as sink:
        monkeypatch.setattr(phase_trace, "_sink", sink)
        monkeypatch.setattr(phase_trace, "_pending", [])
        phase_trace.stamp("phase-1", "checks")
        spin = phase_trace.time.thread_time() + 0.02
        while phase_trace.time.thread_time() < spin:  # 20 ms of this thread's CPU
            pass
        phase_trace.time.sleep(0.05)  # 50 ms of waiting: time, no CPU
        phase_trace.stamp("phase-1", "checked")
        assert path.read_text() == ""  # noted, not yet written: no phase counts the writing
        phase_trace.flush()
    rec = Record(0, "primary", True, 0.0, 0.2, ttft_s=0.1, ok=True, trace_id="phase-1", sent_at=0.0)
    wall = report.trace_phases_ms([rec], phase_trace.read(path))["door: vlguard's input checks"]["p50"]
    cpu_times = phase_trace.read_cpu(path)
    cpu = report.own_cpu_ms([rec], cpu_times)["door: vlguard's input checks"]["p50"]
    assert 20 <= cpu < 40 and wall >= 70, (cpu, wall)
    at, thread = cpu_times["phase-1"]["checked"]
    cpu_times["phase-1"]["checked"] = (at, thread + 1)  # stamped by another thread: no CPU figure
    assert report.own_cpu_ms([rec], cpu_times) == {}


def test_a_plain_function_is_stamped_for_the_request_served_and_passed_through_otherwise(
    sink: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vlguard's parse and image-cache strip: plain functions, stamped for the request in the context."""
    module = types.ModuleType("fake_door")

    def parse(raw: bytes) -> dict[str, bytes]:
        return {"parsed": raw}

    async def check(raw: bytes) -> None:
        return None

    module.parse, module.check = parse, check  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_door", module)
    assert phase_trace.bench.wrap_method("fake_door", None, "parse", phase_trace._traced_sync("parse", "parsed"), None)
    assert module.parse(b"x") == {"parsed": b"x"}  # no request served: nothing noted
    rid = phase_trace.trace_id()
    token = phase_trace._current.set(rid)
    try:
        assert module.parse(b"y") == {"parsed": b"y"}
    finally:
        phase_trace._current.reset(token)
    phase_trace.flush()
    assert list(phase_trace.read(sink)) == [rid] and list(phase_trace.read(sink)[rid]) == ["parse", "parsed"]
    with pytest.raises(phase_trace.HookTargetMissing, match="not the kind"):  # a coroutine function is not plain
        phase_trace.bench.wrap_method("fake_door", None, "check", phase_trace._traced_sync("a", "b"), None)


def test_the_moved_work_is_told_from_what_vlguard_adds() -> None:
    phases = {name: {"p50": 0.1, "mean": 0.1, "n": 1} for name in report.GUARD_OWN_PHASES}
    phases[report.GUARD_MOVED_PHASES[0]] = {"p50": 0.04, "mean": 0.04, "n": 1}
    own, moved = report.added_p50(phases)
    assert (own, moved) == (pytest.approx(0.3), pytest.approx(0.04))
    assert report.added_p50({}) == (0, 0)


async def test_each_request_is_told_by_its_own_headers_whatever_context_it_inherits(sink: Path) -> None:
    """uvicorn may run a connection's next request in the context of the one before (a pipelined request's
    task; the reader resumed from a request's receive): the outermost app point decides afresh."""
    rid, earlier = phase_trace.trace_id(), phase_trace.trace_id()
    seen: list[Any] = []

    async def app(_self: Any, scope: Any, receive: Any, send: Any) -> None:
        seen.append(phase_trace._current.get())
        await send({"type": "http.response.body", "body": b'data: {"content":"a"}', "more_body": False})

    async def send(message: Any) -> None:
        return None

    for inherited, headers in ((phase_trace._UNTRACED, [(b"x-request-id", rid.encode())]), (earlier, [])):
        token = phase_trace._current.set(inherited)
        try:
            await phase_trace._traced_asgi(app)(None, {"type": "http", "headers": headers}, None, send)
        finally:
            phase_trace._current.reset(token)
    assert seen == [rid, phase_trace._UNTRACED]
    assert list(phase_trace.read(sink)) == [rid]  # nothing stamped under the earlier request's id


def test_a_method_is_wrapped_once_whatever_its_wrapper_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's wrapper is a plain function (it hands an untraced call the stream itself): wrapping the
    method again finds the original's kind and installs nothing."""

    class Engine:
        async def generate(self, prompt: str) -> AsyncIterator[str]:
            yield prompt

    module = types.ModuleType("fake_engine")
    module.Engine = Engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_engine", module)
    make = phase_trace._traced_stream("submit", "output", phase_trace._any)
    phase_trace.bench.wrap_method("fake_engine", "Engine", "generate", make, True)
    wrapped = Engine.__dict__["generate"]
    phase_trace.bench.wrap_method("fake_engine", "Engine", "generate", make, True)
    assert Engine.__dict__["generate"] is wrapped
