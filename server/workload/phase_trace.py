"""Per-request TTFT phases in either server's API process (vLLM plugin ``vlguard_phase_trace``, bench only).

``vlguard bench compare`` starts both servers (stock vLLM and vlguard) with ``VLGUARD_PHASE_TRACE=<file>``
and sends every request with an ``X-Request-Id`` from :func:`trace_id`. In the API process (the one
without a multiprocessing parent; engine processes are left alone) the plugin wraps, at class level, the
points a chat request passes through and appends one JSON line ``{"id", "point", "t", "cpu", "tid"}`` per
request and point to the file:

===============  ===================================================================================
point            stamped when
===============  ===================================================================================
``asgi``         the FastAPI application is called for the request (uvicorn has parsed its headers)
``input_guard``  vlguard's input checks start (vlguard only)
``checks``       the body is read: vlguard's input checks start (vlguard only)
``checked``      vlguard's input checks end (vlguard only)
``admission``    vlguard's admission middleware starts (vlguard only)
``handler``      vLLM's chat handler starts (``OpenAIServingChat.create_chat_completion``): the body is
                 read, every middleware passed, the request model validated
``rendered``     vLLM's renderer returns (chat template, image loading and Hugging Face preprocessing
                 or a processor-cache hit)
``guard``        vlguard's engine client starts the request (vlguard only)
``submit``       ``AsyncLLM.generate`` starts the request (engine input, then the engine core)
``output``       ``AsyncLLM.generate`` yields its first output
``guard_out``    vlguard's engine client yields its first output (vlguard only)
``chunk``        the chat stream generator yields its first chunk with content
``sent``         the first response body with content is handed to the HTTP server (``send``)
===============  ===================================================================================

Times are ``time.monotonic()`` seconds: CLOCK_MONOTONIC, one clock for every process of the machine, so
the bench client's send and first-token times (:mod:`server.workload.generator`) line up with them.
``cpu`` is the stamping thread's CPU time (``time.thread_time()``), ``tid`` that thread: between two
points stamped by one thread with no wait between them (vlguard's input checks, its engine client), the
CPU a phase used, which its time does not give under load (it also counts waiting for the GIL while the
processor's threads hold it). A
point vLLM does not have under that name, or not as the kind of function wrapped, is skipped with a
warning. A traced request's points are noted in memory and written as its response ends (a phase does not
count the writing of the point that opens it); a traced stream passes through one more async-generator step
per item. An untraced request pays a few microseconds a wrapped call and no step per item, so the rounds
that compare CPU do not charge vlguard's four more points (its door and its engine client) for more than
that (``vlguard bench compare --no-trace`` measures without any). Only the API process of a server is
traced (with ``--api-server-count`` above 1 there is none: nothing is traced).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import math
import multiprocessing
import os
import re
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from threading import get_ident
from typing import IO, Any, NamedTuple

from server.vllm_hooks import HookTargetMissing, bench
from server.workload import PHASE_TRACE_ENV as ENV

_ID = re.compile(r"phase-[0-9a-f]{16}")
_CONTENT = re.compile(r'"content":"[^"]')  # a chunk whose delta has text (what the client times)
_CONTENT_BYTES = re.compile(_CONTENT.pattern.encode())  # the same, in a response body

logger = logging.getLogger("vllm.vlguard.phase_trace")
#: the trace id of the request being served; :data:`_UNTRACED` while serving one that carries none
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("vlguard_phase_trace_id", default=None)
_UNTRACED = ""
_SCOPE_MARK = "vlguard.phase_trace"  # in a request's ASGI scope once its outermost app point has it
_sink: IO[str] | None = None
_pending: list[tuple[str, str, float, float, int]] = []  # points noted and not yet written
_FLUSH_AT = 10_000


def trace_id() -> str:
    """A fresh request id the tracer recognises (send it as ``X-Request-Id``)."""
    return "phase-" + secrets.token_hex(8)


def request_id_of(*values: Any) -> str | None:
    """The trace id in the first of ``values`` that carries one: a string (vLLM's request ids embed the
    header's value), an object with ``headers`` (Starlette's request) or an ASGI scope."""
    for value in values:
        if isinstance(value, str):
            found = _ID.search(value)
        elif isinstance(value, dict) and "headers" in value:
            header = next((v for k, v in value["headers"] if k == b"x-request-id"), b"")
            found = _ID.search(header.decode("latin-1"))
        elif (headers := getattr(value, "headers", None)) is not None and hasattr(headers, "get"):
            found = _ID.search(headers.get("x-request-id") or "")
        else:
            continue
        if found:
            return found.group(0)
    return None


def stamp(rid: str | None, point: str) -> None:
    """Note one point of request ``rid`` (nothing when the request is not traced): its time, and the
    stamping thread's CPU time and identity. Kept in memory until :func:`flush` (the ASGI point flushes as
    a traced response ends), so that a phase does not count the writing of the point that opens it."""
    if rid is not None and _sink is not None:
        _pending.append((rid, point, time.monotonic(), time.thread_time(), get_ident()))
        if len(_pending) >= _FLUSH_AT:  # a bound on memory where no response ends
            flush()


def flush() -> None:
    """Write every point noted so far to the trace file."""
    if _sink is None or not _pending:
        return
    events, _pending[:] = list(_pending), []
    _sink.write("".join(
        json.dumps({"id": rid, "point": point, "t": t, "cpu": cpu, "tid": tid}) + "\n"
        for rid, point, t, cpu, tid in events
    ))  # fmt: skip


def _args_id(args: tuple[Any, ...], kwargs: dict[str, Any], from_context: bool) -> str | None:
    """The trace id of a method call: in its arguments (``self`` left out), else, for ``from_context``
    points (calls that carry no request of their own), the id of the request being served. None at once
    while serving an untraced request (what the rounds that compare CPU send)."""
    current = _current.get()
    if current == _UNTRACED:
        return None
    return request_id_of(*args[1:], *kwargs.values()) or (current if from_context else None)


def _traced_asgi(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    async def traced(app: Any, scope: Any, receive: Any, send: Any) -> None:
        # An app inside a served request's app (vlguard's shell hands on to vLLM's) is passed: the request
        # is marked in its scope, not by the context, which uvicorn may carry from one request of a
        # connection to the next (a pipelined request's task; the reader resumed from a request's receive).
        if scope.get("type") != "http" or scope.get(_SCOPE_MARK):
            return await call(app, scope, receive, send)
        scope[_SCOPE_MARK] = True
        rid = request_id_of(scope)  # the context is set for every request: nothing is inherited
        token = _current.set(_UNTRACED if rid is None else rid)  # untraced: every point inside passes at once
        try:
            if rid is None:
                return await call(app, scope, receive, send)
            stamp(rid, "asgi")
            return await call(app, scope, receive, _traced_send(rid, send))
        finally:
            _current.reset(token)
            if rid is not None:
                flush()

    return traced


def _traced_send(rid: str, send: Any) -> Callable[[Any], Any]:
    """``send`` stamping ``sent`` at the first response body with content, and writing the request's points
    before its last body is handed on."""
    sent = False

    async def traced_send(message: Any) -> None:
        nonlocal sent
        is_body = message.get("type") == "http.response.body"
        body = message.get("body", b"") if is_body else b""
        if not sent and _CONTENT_BYTES.search(body):
            sent = True
            stamp(rid, "sent")
        if is_body and not message.get("more_body", False):
            flush()  # every point of the request is noted: written before the client has its end
        await send(message)

    return traced_send


def _traced_call(
    point_at_start: str | None, point_at_end: str | None, from_context: bool = False
) -> Callable[..., Any]:
    def wrap(call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        async def traced(*args: Any, **kwargs: Any) -> Any:
            rid = _args_id(args, kwargs, from_context)
            if point_at_start:
                stamp(rid, point_at_start)
            result = await call(*args, **kwargs)
            if point_at_end:
                stamp(rid, point_at_end)
            return result

        return traced

    return wrap


def _traced_stream(start: str | None, first: str, is_first: Callable[[Any], bool]) -> Callable[..., Any]:
    """A wrapper of an async generator function: a traced request's stream passes through a generator that
    stamps ``start`` (at its first step) and ``first``; any other request gets the stream itself, so an
    untraced request pays no step per item for the wrapper (a server with more points wrapped, vlguard's,
    would pay more than stock in the rounds that compare their CPU)."""

    def wrap(call: Callable[..., Any]) -> Callable[..., Any]:
        async def traced_items(rid: str, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
            if start:
                stamp(rid, start)
            pending = True
            async with contextlib.aclosing(items):  # type: ignore[type-var]  # an async generator
                async for item in items:
                    if pending and is_first(item):
                        pending = False
                        stamp(rid, first)
                    yield item

        @functools.wraps(call)
        def traced(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            rid = _args_id(args, kwargs, from_context=False)
            items = call(*args, **kwargs)
            return items if rid is None else traced_items(rid, items)

        return traced

    return wrap


def _any(output: Any) -> bool:
    return True  # an engine client's first output, whatever it holds


def _has_content(chunk: Any) -> bool:
    return isinstance(chunk, str) and _CONTENT.search(chunk) is not None


def _traced_sync(start: str, end: str) -> Callable[..., Any]:
    """A wrapper of a plain function called while a request is served: ``start`` and ``end`` around it
    (nothing when it raises), for the request being served (the context's)."""

    def wrap(call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def traced(*args: Any, **kwargs: Any) -> Any:
            rid = _current.get()
            if not rid:  # no request, or an untraced one
                return call(*args, **kwargs)
            stamp(rid, start)
            result = call(*args, **kwargs)
            stamp(rid, end)
            return result

        return traced

    return wrap


class _Point(NamedTuple):
    """A function to wrap: ``module.cls.method`` (``module.method`` when ``cls`` is None), an async
    generator function when ``stream``, a coroutine function when False, a plain function when None; and
    its wrapper."""

    module: str
    cls: str | None
    method: str
    stream: bool | None
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]


_SERVING = "vllm.entrypoints.openai.chat_completion.serving"
_POINTS = (
    _Point("fastapi", "FastAPI", "__call__", False, _traced_asgi),
    _Point(_SERVING, "OpenAIServingChat", "create_chat_completion", False, _traced_call("handler", None)),
    _Point(_SERVING, "OpenAIServingChat", "render_chat_request", False, _traced_call(None, "rendered", True)),
    _Point("vllm.v1.engine.async_llm", "AsyncLLM", "generate", True, _traced_stream("submit", "output", _any)),
    _Point(
        _SERVING,
        "OpenAIServingChat",
        "chat_completion_stream_generator",
        True,
        _traced_stream(None, "chunk", _has_content),
    ),
)
#: vlguard's door and engine client, wrapped where vlguard serves (``server.cli`` runs it; stock vLLM never
#: imports it)
_GUARD_POINTS = (
    _Point("server.api.input_guard", "InputGuardMiddleware", "__call__", False, _traced_call("input_guard", None)),
    _Point("server.api.input_guard", "InputGuardMiddleware", "_check", False, _traced_call("checks", "checked", True)),
    _Point("server.api.admission", "AdmissionMiddleware", "__call__", False, _traced_call("admission", None)),
    _Point(
        "server.guard.engine_client",
        "GuardedEngineClient",
        "generate",
        True,
        _traced_stream("guard", "guard_out", _any),
    ),
    # Inside those: the body's one parse (vLLM's route takes the door's instead of parsing it again) and
    # the engine core's image cache shadow (server.workload.report.GUARD_MOVED_PHASES says which is moved)
    _Point("server.api.input_guard", None, "_parse_json", None, _traced_sync("parse", "parsed")),
    _Point("server.guard.ipc_cache", "EngineCacheShadow", "strip", None, _traced_sync("strip", "stripped")),
)


def install(path: str, guard: bool | None = None) -> list[str]:
    """Wrap every point this process has and open ``path`` for appending. Idempotent.

    Arguments:
        guard: whether vlguard's own points are wrapped too; None: where vlguard serves (``server.cli`` is
            loaded), as the plugin decides.

    Returns:
        ``module.Class.method`` of each point wrapped.
    """
    global _sink
    if _sink is not None:
        return []
    _sink = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the process's life
    if guard is None:
        guard = "server.cli" in sys.modules
    points = [*_POINTS, *(_GUARD_POINTS if guard else ())]
    wrapped = []
    for point in points:
        try:
            wrapped.append(bench.wrap_method(point.module, point.cls, point.method, point.wrap, point.stream))
        except HookTargetMissing as exc:
            logger.warning("vlguard phase trace: %s; not traced", exc)
    return wrapped


def trace_engine_client(cls: type) -> None:
    """Stamp ``submit`` and ``output`` on ``cls.generate``, an engine client standing in for ``AsyncLLM``
    (the front bench's null engine, :mod:`server.workload.front`)."""
    bench.wrap_method(cls.__module__, cls.__qualname__, "generate", _traced_stream("submit", "output", _any), True)


def register() -> None:
    """Plugin entry point: :func:`install` in the API process when ``VLGUARD_PHASE_TRACE`` names a file."""
    path = os.environ.get(ENV)
    if not path or multiprocessing.parent_process() is not None or _sink is not None:
        return
    try:
        logger.info("vlguard: phase trace to %s (%s)", path, ", ".join(install(path)))
    except Exception:
        logger.exception("vlguard: phase trace not installed")


def read(path: str | os.PathLike[str]) -> dict[str, dict[str, float]]:
    """A trace file as ``{request id: {point: first time}}`` (a replayed request keeps its first stamps)."""
    return {rid: {point: t for point, (t, _, _) in points.items()} for rid, points in _read(path).items()}


def read_cpu(path: str | os.PathLike[str]) -> dict[str, dict[str, tuple[float, int]]]:
    """A trace file's thread CPU times: ``{request id: {point: (CPU seconds, thread)}}`` (first stamps)."""
    return {rid: {point: (cpu, tid) for point, (_, cpu, tid) in points.items()} for rid, points in _read(path).items()}


def _read(path: str | os.PathLike[str]) -> dict[str, dict[str, tuple[float, float, int]]]:
    events: dict[str, dict[str, tuple[float, float, int]]] = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                event = json.loads(line)
                found = (event["t"], event.get("cpu", math.nan), event.get("tid", 0))
                events.setdefault(event["id"], {}).setdefault(event["point"], found)
    return events
