"""Refuse bad or excessive generation requests at the door (pure ASGI middleware).

For every ``POST``, by its route's kind (:mod:`server.api.routes`; paths compared without ``--root-path``),
before vLLM sees the request: a route not classified there, or refused, gets **404** (deny by default);
routes that take no prompt or media (``/detokenize``, derender) get steps 1 and 2 and the body's size
bounds (JSON values and objects, and token ids: at most ``max_sequences`` sequences of the model's
context); input routes (``/tokenize``, render) all but step 3:

1. the body is read up to ``max_request_mb`` (``Content-Length`` first, then the bytes actually sent);
   more gets **413**; a body that has not arrived within ``body_timeout`` seconds gets **408**. The
   bodies inside at once (received, checked, held while the engine restarts, served) are bounded by
   ``max_body_memory_mb`` in all, counted as their bytes arrive: one more byte gets **429** +
   ``Retry-After`` (**503** while the engine restarts);
2. once its body has arrived (a stalled upload holds no slot), at most ``max_inflight`` such requests are
   inside vlguard at once (held, queued in vLLM, running or streaming); one more gets **429** +
   ``Retry-After``. :meth:`InputGuardMiddleware.saturated` tells readiness when no slot or byte is left;
3. a generation request's inputs known to fault the engine are refused with **400**
   (:mod:`server.api.poison`: non-finite numbers, structured outputs without a usable constraint or
   that the engine's backend cannot compile, out-of-vocabulary token ids, literal placeholder tokens);
4. a JSON body's media items are counted against vLLM's per-prompt limit before anything is decoded,
   then its media parts and ``mm_processor_kwargs`` are checked by :func:`server.api.media.check_media`
   (**400**/**413** with a message naming the part: schemes, ``data:`` forms and sizes; nothing decoded).
   An image's base64, header, pixels and checksums are checked, and the image normalised, where vLLM
   loads it (:mod:`server.api.media_policy`: every route and part shape). A body that is not JSON goes
   on to vLLM, whose own 400 names the problem; JSON that is not an object, or nested too deeply for
   Python's parser, gets **400** here (vLLM's request models would answer those with a 500);
5. with ``--guard-remote-media on``, remote images are fetched under vlguard's policy and inlined
   (:mod:`server.api.remote_media`; **400**/**413**/**504**), after the count.

The body is then handed on (unchanged unless client uuids were dropped or remote images inlined), with the
door's parse of it, which vLLM's route takes instead of parsing it again (:mod:`server.api.parsed_body`). Every
refusal uses the OpenAI error envelope and is counted in ``vlguard_requests_rejected_total{reason}``.
When a request ends its body leaves the budget, and what its parse leaves behind is bounded too
(:mod:`server.api.garbage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, NamedTuple

import pydantic_core
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.admission import route_path
from server.api.caller import Arrival, Caller, timeout_of
from server.api.errors import RETRY_AFTER_S, anthropic_client_errors, error_response
from server.api.fields import check_fields
from server.api.garbage import FinishedBodies
from server.api.media import (
    MediaCheck,
    MediaError,
    PixelBounds,
    check_media,
    count_items,
    strip_client_uuids,
)
from server.api.media_policy import MediaPolicy
from server.api.overload import AdmissionGate, Refusal
from server.api.parsed_body import hand_over
from server.api.poison import (
    PoisonRules,
    check_constraint,
    check_known_poison,
    check_prompt_length,
    check_sequences,
    check_token_count,
    walk,
)
from server.api.remote_media import inline_remote_media
from server.api.routes import RouteKind, post_kind
from server.api.stream_start import refusals_before_start
from server.guard.clients import client_key
from server.guard.engine_client import new_request
from server.guard.forensics import current_request
from server.metrics import definitions as m
from server.settings import GuardSettings

#: Bodies above this many bytes are parsed and checked off the event loop.
_OFFLOAD_BYTES = 1 << 20


_MALFORMED = object()

#: The most digits pydantic's JSON parser takes in an integer (CPython's default for ``int()``, 4300).
_PYDANTIC_INT_DIGITS = 4300


def _no_constant(name: str) -> Any:
    raise MediaError(
        HTTPStatus.BAD_REQUEST, f"request body: {name} is not a finite JSON number and is not accepted", "poison"
    )


def _parse_json(raw: bytes) -> Any:
    """The request body parsed, or :data:`_MALFORMED`. pydantic's JSON parser first (~5x the standard
    library's on a body with an image), refusing ``NaN`` and ``Infinity`` while it parses; what it refuses
    (those, depth over its limit of 200, lone surrogates, a byte-order mark, UTF-16 or UTF-32, malformed
    JSON, integers over 4300 digits) is parsed again by ``json``, whose result vLLM's own parser would see.
    Where the interpreter's integer digit limit is lower (``PYTHONINTMAXSTRDIGITS``), ``json`` alone.

    Raises:
        MediaError: 400 for ``NaN``/``Infinity`` (vLLM's parser takes them; the engine faults on some), and
            for JSON nested too deeply for ``json`` (FastAPI's parser would answer 500).
    """
    if not 0 < sys.get_int_max_str_digits() < _PYDANTIC_INT_DIGITS:  # else json refuses integers pydantic takes
        try:
            return pydantic_core.from_json(raw, allow_inf_nan=False)
        except ValueError:
            pass
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except MediaError:
        raise
    except ValueError:
        return _MALFORMED
    except RecursionError:
        raise MediaError(HTTPStatus.BAD_REQUEST, "request body: JSON nested too deeply", "body") from None


def _dumps(body: dict[str, Any]) -> bytes:
    """A rewritten body as compact UTF-8 JSON: about the size the client sent (``ensure_ascii`` would grow
    non-ASCII text up to six times past the bytes the body budget counted)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class Counts(dict[str, int]):
    """Per-client counts that drop a client at zero (``""``, no identity, is never counted)."""

    def add(self, who: str, n: int) -> None:
        if who and (total := self.get(who, 0) + n) > 0:
            self[who] = total
        elif who:
            self.pop(who, None)


def _arrival(
    scope: Scope, kind: RouteKind, gate: AdmissionGate | None, who: str, held: dict[str, int]
) -> Arrival | Refusal:
    """When a request arrived and, for a generation request, its ``X-Request-Timeout``; or its refusal: a
    malformed timeout (400), or the load (:meth:`AdmissionGate.before_body`: before its body is read)."""
    arrived = asyncio.get_running_loop().time()
    if kind is not RouteKind.GENERATION:
        return Arrival(arrived, None)
    try:
        timeout_s = timeout_of(scope)
    except ValueError as exc:
        return Refusal(HTTPStatus.BAD_REQUEST, str(exc), "body", 0)
    if gate is not None and (no := gate.before_body(who, held, timeout_s)):
        return no
    return Arrival(arrived, timeout_s)


class _Inspected(NamedTuple):
    """What the door's synchronous checks of a body found (:meth:`InputGuardMiddleware._inspect`)."""

    parsed: Any  # the body's parse (json.loads's values), or _MALFORMED
    changed: bool  # client uuids dropped
    constraint: dict[str, Any] | None  # the structured-output constraint to compile
    media: MediaCheck | None  # None: content not checked (not JSON, or a route that takes no input)


class InputGuardMiddleware:
    """Arguments:
    app: the ASGI app to protect.
    settings: the limits (``max_inflight``, ``max_request_mb``, the body budget and timeouts).
    media: the server's media policy (:class:`server.api.media_policy.MediaPolicy`: its media limits and
        remote-media hosts), the same one vLLM's media connector applies.
    pixel_bounds: returns the server's processed image size bounds once the engine is up (``None``: not
        known yet, or the model's processor has none).
    item_limits: returns vLLM's per-prompt media limits (modality -> most items; ``--limit-mm-per-prompt``).
    poison_rules: returns the served model's facts for the known-poison rules once the engine is up
        (:mod:`server.api.poison`; ``None``: not known yet).
    engine_ready: whether the engine serves now (a body over the memory budget then gets 429, else 503).
    expose: called with the middleware once built (the app keeps it for readiness).
    keys: how many API keys the server has (a client's identity: :func:`server.guard.clients.client_key`).
    gate: admission under load (:mod:`server.api.overload`); None: none."""

    def __init__(
        self,
        app: ASGIApp,
        settings: GuardSettings,
        media: MediaPolicy,
        pixel_bounds: Callable[[], PixelBounds | None] = lambda: None,
        item_limits: Callable[[], dict[str, int] | None] = lambda: None,
        poison_rules: Callable[[], PoisonRules | None] = lambda: None,
        engine_ready: Callable[[], bool] = lambda: True,
        expose: Callable[[InputGuardMiddleware], None] = lambda guard: None,
        keys: int = 0,
        gate: AdmissionGate | None = None,
    ) -> None:
        self.app = app
        self.gate = gate
        self.poison_rules = poison_rules
        self.max_inflight = settings.max_inflight
        self.max_body = int(settings.max_request_mb * 1024 * 1024)
        self.limits, self.remote = media.limits, media.remote  # the media policy vLLM's connector applies too
        self.pixel_bounds = pixel_bounds
        self.item_limits = item_limits
        self.active = 0
        self.client_active = Counts()  # client identity -> its requests holding a slot now
        self.client_inflight = max(1, int(settings.max_inflight * settings.inflight_share))
        self.body_budget = settings.body_memory_bytes()
        self.body_bytes = 0  # bytes of the bodies inside now (received, checked, held, served)
        self.finished = FinishedBodies.for_budget(self.body_budget)  # and what they leave behind when done
        self.keys = keys
        self.client_share = int(self.body_budget * settings.body_share)
        self.client_bytes = Counts()  # client identity -> bytes its bodies hold now
        self.engine_ready = engine_ready
        self.body_timeout = settings.body_timeout
        self.max_json_items = settings.max_json_items
        self.max_sequences = settings.max_sequences
        self.max_json_objects = settings.max_json_objects
        expose(self)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST"):
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        found = post_kind(path)
        if found is None or found[0] is RouteKind.REFUSED:
            why = found[1] if found is not None else "vlguard's input guard does not know this route"
            await self._refuse(scope, receive, send, HTTPStatus.NOT_FOUND, f"POST {path} is not served: {why}", "route")
            return
        kind = found[0]
        held = [0]  # bytes this request holds of the body budget
        who = client_key(scope, self.keys)
        if isinstance(arrival := _arrival(scope, kind, self.gate, who, self.client_active), Refusal):
            await self._refuse(scope, receive, send, arrival.status, arrival.message, arrival.reason, arrival.headers())
            return
        try:  # every body is bounded (size, time, budget, the client's share); only inputs are checked
            with self.gate.admitted() if self.gate and kind is RouteKind.GENERATION else contextlib.nullcontext():
                await self._admit(scope, receive, send, held, who, kind, arrival)
        finally:
            self.body_bytes -= held[0]
            self.client_bytes.add(who, -held[0])
            m.BODY_BYTES.set(self.body_bytes)
            self.finished.finished(held[0])

    def saturated(self) -> bool:
        """Whether one more request would be refused for the server's load (every in-flight slot taken, the
        body budget spent, or the engine's queue past --guard-max-queue-wait): readiness reports it, so a
        balancer routes elsewhere."""
        if (self.max_inflight and self.active >= self.max_inflight) or self.body_bytes >= self.body_budget:
            return True
        return self.gate is not None and self.gate.saturated()

    def _largest(self, who: str) -> int:
        """The largest body client ``who`` may send: the request limit, the budget, the client's share."""
        return min(self.max_body, self.body_budget, self.client_share if who else self.body_budget)

    def _take(self, held: list[int], n: int, who: str) -> str:
        """Count ``n`` more body bytes for a request (``held``) of client ``who`` if the budget and the
        client's share allow them; else the refusal's reason."""
        if who and self.client_bytes.get(who, 0) + n > self.client_share:
            return "client_memory"
        if self.body_bytes + n > self.body_budget:
            return "memory"
        self.body_bytes += n
        held[0] += n
        self.client_bytes.add(who, n)
        m.BODY_BYTES.set(self.body_bytes)
        return ""

    async def _refuse_memory(self, scope: Scope, receive: Receive, send: Send, who: str, reason: str) -> None:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if reason == "client_memory":  # this client's own uploads: never the server's state
            message = (f"Too many request bodies in progress from this client: they hold {self.client_bytes[who]} "
                       f"bytes (limit {self.client_share} per client); retry later")  # fmt: skip
            await self._refuse(scope, receive, send, HTTPStatus.TOO_MANY_REQUESTS, message, reason, headers)
            return
        ready = self.engine_ready()
        status = HTTPStatus.TOO_MANY_REQUESTS if ready else HTTPStatus.SERVICE_UNAVAILABLE
        message = (
            f"Server busy: the request bodies in progress hold {self.body_bytes} bytes "
            f"(limit {self.body_budget}{'' if ready else ', engine restarting'}); retry later"
        )
        await self._refuse(scope, receive, send, status, message, "memory", headers)

    async def _admit(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        held: list[int],
        who: str,
        kind: RouteKind,
        arrival: Arrival,
    ) -> None:
        too_large = HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"Request body larger than {self._largest(who)} bytes"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._largest(who):
            await self._refuse(scope, receive, send, *too_large, "body_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        refusal = ""  # decided inside the timed read, answered outside it (a slow reader cannot get two)
        try:
            async with asyncio.timeout(self.body_timeout):  # a stalled upload holds no slot, and not forever
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self._largest(who):  # could never fit: 413, not 429
                        refusal = "body_too_large"
                        break
                    if refusal := self._take(held, len(chunk), who):
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            refusal = "body_timeout"
        if refusal == "body_too_large":
            await self._refuse(scope, receive, send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"Request body larger than {self._largest(who)} bytes", "body_too_large")  # fmt: skip
            return
        if refusal in ("memory", "client_memory"):
            await self._refuse_memory(scope, receive, send, who, refusal)
            return
        if refusal == "body_timeout":
            message_ = f"Request body not received within {self.body_timeout:g} s"
            await self._refuse(scope, receive, send, HTTPStatus.REQUEST_TIMEOUT, message_, "body_timeout")
            return
        raw = b"".join(chunks)
        del chunks
        # Only a request whose body arrived takes an in-flight slot: stalled uploads cannot fill them.
        if self.max_inflight and self.active >= self.max_inflight:
            message_ = f"Server busy: {self.active} requests in progress (limit {self.max_inflight}); retry later"
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            await self._refuse(scope, receive, send, HTTPStatus.TOO_MANY_REQUESTS, message_, "overload", headers)
            return
        if who and self.max_inflight and self.client_active.get(who, 0) >= self.client_inflight:
            message_ = (f"Too many requests in progress from this client: {self.client_active[who]} "
                        f"(limit {self.client_inflight} per client); retry later")  # fmt: skip
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            await self._refuse(scope, receive, send, HTTPStatus.TOO_MANY_REQUESTS, message_, "client_overload", headers)
            return
        self.active += 1
        self.client_active.add(who, 1)
        try:
            await self._serve(scope, receive, send, raw, kind, arrival)
        finally:
            self.active -= 1
            self.client_active.add(who, -1)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, raw: bytes, kind: RouteKind, arrival: Arrival
    ) -> None:
        try:
            checked, parsed = await self._check(raw, kind)
        except MediaError as exc:
            retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == HTTPStatus.SERVICE_UNAVAILABLE else None
            await self._refuse(scope, receive, send, exc.status, str(exc), exc.reason, retry)
            return
        if kind is RouteKind.GENERATION and self.gate is not None:
            who = client_key(scope, self.keys)
            if no := self.gate.after_body(who, self.client_active, arrival.timeout_s, parsed):
                await self._refuse(scope, receive, send, no.status, no.message, no.reason, no.headers())
                return
        if checked is not raw:  # client uuids dropped or remote media inlined: hand on the rewritten body
            raw = checked
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        if parsed is not _MALFORMED:  # vLLM's route takes the door's parse of these bytes: parsed once
            scope = hand_over(scope, raw, parsed)
        del parsed  # the scope holds it until taken, or dropped if the request waits for the engine

        current_request.set((f"POST {route_path(scope)}", raw))  # the forensic record's (server.guard.forensics)
        new_request()  # not entered until vLLM's serving layer hands this request to the engine client
        caller = Caller(receive, raw, arrival)
        scope[Caller.SCOPE_KEY] = caller  # the hold at the door waits for the engine only while it is there
        reply = refusals_before_start(caller.sender(send))  # an engine refusal answered before a stream's 200
        if route_path(scope).startswith("/v1/messages"):  # vLLM's Anthropic routes answer every error 500
            reply = anthropic_client_errors(reply)
        try:
            await self.app(scope, caller.receive, reply)
        finally:
            await caller.finish(scope, send)

    def _inspect(self, raw: bytes, kind: RouteKind) -> _Inspected:
        """Parse the body once and run every check that needs no waiting (blocking: O(body); a large body's
        run off the event loop): the body's shape and size in values, objects and (a route that takes no
        input) token ids; then uuids dropped, media counted, known poison, media headers.

        Raises:
            MediaError: the refusal.
        """
        # Before parsing, a bound on values of any kind: commas counted at C speed, where there can be more
        # commas than the bound (no fewer bytes than commas)
        if len(raw) > self.max_json_items and raw.count(b",") > self.max_json_items:
            message = f"request body holds more than {self.max_json_items} JSON values"
            raise MediaError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message, "body_too_large")
        body = _parse_json(raw)
        if body is _MALFORMED:
            return _Inspected(body, False, None, None)  # vLLM answers malformed JSON with its own 400
        walked = walk(body, self.max_json_objects)  # the door's one walk of the whole body
        if walked.objects > self.max_json_objects:  # vLLM validates each on the event loop: ~6 us apiece
            message = f"request body holds more than {self.max_json_objects} JSON objects"
            raise MediaError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message, "body_too_large")
        rules = self.poison_rules()
        if kind is RouteKind.NO_INPUT:  # token ids to text (detokenize, derender), or no body: nothing else
            check_token_count(body, rules, self.max_sequences)
            return _Inspected(body, False, None, None)
        if not isinstance(body, dict):  # vLLM's request models' before-validators call .get() on it: a 500
            message = f"request body must be a JSON object, not {type(body).__name__}"
            raise MediaError(HTTPStatus.BAD_REQUEST, message, "body")
        # Client uuids dropped first: the media checks then read each part as vLLM will without them.
        stripped = 0 if self.limits.trust_client_uuids else strip_client_uuids(body)
        bounds, items = self.pixel_bounds(), self.item_limits()
        if items is not None:  # before any other work: more items than allowed are refused at once
            count_items(body, items)
        check_prompt_length(walked, rules)  # before anything tokenizes it (the door's own walks are bounded too)
        check_fields(body)  # the fields beside the input: vLLM works through their items one by one
        generation = kind is RouteKind.GENERATION
        if generation:
            check_sequences(body, self.max_sequences)
        constraint = check_known_poison(body, rules, walked) if generation else None
        return _Inspected(body, stripped > 0, constraint, check_media(body, self.limits, bounds))

    async def _check(self, raw: bytes, kind: RouteKind = RouteKind.GENERATION) -> tuple[bytes, Any]:
        """Check the body's known poison (generation routes) and media; returns the body to hand on (``raw``,
        or a rewritten one when anything was changed: client uuids dropped, remote media inlined) and its
        parse (:data:`_MALFORMED`: not JSON). A body above :data:`_OFFLOAD_BYTES` is parsed and checked off
        the event loop (other requests, /health and streams keep it).

        Raises:
            MediaError: the refusal.
        """
        if len(raw) > _OFFLOAD_BYTES:
            found = await asyncio.to_thread(self._inspect, raw, kind)
        else:  # under a millisecond: a hop to a thread and back cost more under load, when the loop is busy
            found = self._inspect(raw, kind)
        if found.media is None:
            return raw, found.parsed
        body: dict[str, Any] = found.parsed  # a JSON object: its content was checked
        if found.constraint is not None:
            await asyncio.to_thread(check_constraint, found.constraint, self.poison_rules())
        fetched = 0
        if self.limits.remote_media:
            fetched = await inline_remote_media(body, self.limits, self.remote)
        if not (found.changed or fetched > 0):
            return raw, body
        if len(raw) > _OFFLOAD_BYTES:
            return await asyncio.to_thread(_dumps, body), body
        return _dumps(body), body

    @staticmethod
    async def _refuse(
        scope: Scope,
        receive: Receive,
        send: Send,
        status: HTTPStatus,
        message: str,
        reason: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        m.REQUESTS_REJECTED.labels(reason=reason).inc()
        await error_response(status, message, headers=headers)(scope, receive, send)
