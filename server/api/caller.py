"""A generation request's caller, from the door on: whether it is still there, and its deadline.

The door reads a request's body; from then on :class:`Caller` stands between vLLM's app and the server:

- ``receive`` hands vLLM's route the body once, then an ``http.disconnect`` when the caller has gone;
  vLLM's own cancellation (``with_cancellation`` for unstreamed routes, Starlette's streaming response)
  then aborts the request in the engine, wherever it is (queued, prefilling, decoding);
- one task listens for the real disconnect from the moment the body arrived, so a request that waits
  where nothing reads (held while the engine restarts, on probation) learns of it too (:attr:`gone`);
- a request's ``X-Request-Timeout: S`` (seconds from its arrival) is its deadline: at S the request is
  ended as if its caller had gone, and the caller gets a 504 in the OpenAI envelope, or, on a stream
  already started, an error event and the stream's end (what vLLM's app would send for a disconnected
  caller is dropped).
"""

from __future__ import annotations

import asyncio
import json
import re
from http import HTTPStatus
from typing import NamedTuple

from starlette.types import Message, Receive, Scope, Send

from server.api.errors import error_response
from server.metrics import definitions as m


class Arrival(NamedTuple):
    """When a request arrived (the event loop's clock) and its ``X-Request-Timeout`` (None: no deadline)."""

    arrived: float
    timeout_s: float | None


class Caller:
    """Arguments:
    receive: the server's receive channel (the body already read from it).
    body: the body to hand vLLM's route.
    arrival: when the request arrived and its timeout; its deadline counts from its arrival."""

    #: The scope key under which the door leaves the request's caller for the layers behind it.
    SCOPE_KEY = "vlguard.caller"

    def __init__(self, receive: Receive, body: bytes, arrival: Arrival) -> None:
        self.body: bytes | None = body
        arrived, timeout_s = arrival
        self.timeout_s = timeout_s
        self.gone = asyncio.Event()
        self.reason = ""  # "disconnect" or "deadline" once gone
        self.started = self.completed = False  # the response's start and end went out
        loop = asyncio.get_running_loop()
        self._listener = loop.create_task(self._listen(receive))
        self._timer = loop.call_at(arrived + timeout_s, self._leave, "deadline") if timeout_s is not None else None

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._leave("disconnect")

    def _leave(self, reason: str) -> None:
        if self.gone.is_set() or self.completed:
            return
        self.reason = reason
        self.gone.set()
        m.REQUESTS_CANCELLED.labels(reason=reason).inc()

    async def receive(self) -> Message:
        """The body once, then ``http.disconnect`` when the caller has gone (or its deadline passed)."""
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def sender(self, send: Send) -> Send:
        """``send`` as vLLM's app may use it: after a deadline passed, what the app sends is dropped (the
        door answers instead: :meth:`finish`)."""

        async def caller_send(message: Message) -> None:
            if self.reason == "deadline":
                return
            if message["type"] == "http.response.start":
                self.started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.completed = True
            await send(message)

        return caller_send

    async def finish(self, scope: Scope, send: Send) -> None:
        """After the app returned: the answer to a request whose deadline passed; stop listening."""
        self._listener.cancel()
        if self._timer is not None:
            self._timer.cancel()
        if self.reason != "deadline" or self.completed or self.timeout_s is None:
            return
        message = f"Request not answered within its X-Request-Timeout of {self.timeout_s:g} s"
        if not self.started:
            await error_response(HTTPStatus.GATEWAY_TIMEOUT, message, param="x-request-timeout")(
                scope, self._closed_receive, send
            )
            return
        error = {"error": {"message": message, "type": "Gateway Timeout", "param": None, "code": 504}}
        event = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": event, "more_body": False})

    @staticmethod
    async def _closed_receive() -> Message:
        return {"type": "http.disconnect"}


#: An ``X-Request-Timeout`` value: decimal seconds (``15``, ``2.5``).
_SECONDS = re.compile(rb"[0-9]{1,9}(?:\.[0-9]{1,9})?")


def timeout_of(scope: Scope) -> float | None:
    """The request's ``X-Request-Timeout`` in seconds, None when it sent none.

    Raises:
        ValueError: not a positive finite number of seconds (at most a day).
    """
    for name, value in scope.get("headers") or []:
        if name == b"x-request-timeout":
            seconds = float(value) if _SECONDS.fullmatch(value) else -1.0  # digits, a fraction: nothing else
            if not 0 < seconds <= 86400:
                raise ValueError("X-Request-Timeout must be a number of seconds, above 0 and at most 86400")
            return seconds
    return None
