"""A stream the engine refuses before its first output is answered as the same request unstreamed would be.

vLLM's streamed routes start their response (200, ``text/event-stream``) before the engine client sees the
request; what the engine's input processor then refuses when the request is added (``top_logprobs`` above
``--max-logprobs``, completion prompt token ids outside the vocabulary, and whatever a later vLLM checks
there) arrives as the stream's first event, ``data: {"error": {..., "code": 400}}``, under a 200. A client
that checks the status sees success. :func:`refusals_before_start` holds a stream's start back until its
first body chunk: an error event there goes out as the response itself (its code as the status, vLLM's
OpenAI envelope as the JSON body), anything else after the held start, unchanged. The start waits for the
engine's first output, which the first event waited for anyway.
"""

from __future__ import annotations

import json

from starlette.types import Message, Send

_EVENT = b"data: "


def error_of(chunk: bytes) -> tuple[int, bytes] | None:
    """``(status, envelope JSON)`` when ``chunk`` opens with an SSE error event whose code is an HTTP error
    status (400-599), else None."""
    if not chunk.startswith(_EVENT):
        return None
    event = chunk[len(_EVENT) :].split(b"\n\n", 1)[0]
    try:
        error = json.loads(event)["error"]
        code = int(error["code"])
    except (ValueError, KeyError, TypeError):
        return None
    return (code, json.dumps({"error": error}).encode()) if 400 <= code <= 599 else None


def refusals_before_start(send: Send) -> Send:
    """``send`` for a generation route: a 200 event stream starts only with its first non-empty body chunk,
    and one whose first event is an error is answered with that error instead (see the module docstring)."""
    held: Message | None = None
    answered = False

    async def wrapped(message: Message) -> None:
        nonlocal held, answered
        if answered:
            return  # what the stream sends after its error event (its end): already answered
        if message["type"] == "http.response.start" and message["status"] == 200 and _is_stream(message):
            held = message
            return
        if held is None or message["type"] != "http.response.body":
            await send(message)
            return
        chunk = message.get("body", b"")
        if not chunk and message.get("more_body", False):
            return
        start, held = held, None
        if (error := error_of(chunk)) is None:
            await send(start)
            await send(message)
            return
        status, data = error
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        answered = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    return wrapped


def _is_stream(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", []))
