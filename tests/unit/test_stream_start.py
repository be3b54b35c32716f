"""A stream's first event decides its status (server.api.stream_start): CASES C24 without an engine."""

from __future__ import annotations

import json

import pytest
from starlette.types import Message

from server.api.stream_start import error_of, refusals_before_start

pytestmark = pytest.mark.lane

SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-request-id", b"abc")]
ERROR = {"error": {"message": "top_logprobs 30 above max_logprobs 20", "type": "BadRequestError", "param": None,
                   "code": 400}}  # fmt: skip


async def _through(*messages: Message) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    wrapped = refusals_before_start(send)
    for message in messages:
        await wrapped(message)
    return sent


def _body(data: bytes, more: bool = True) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def test_an_error_as_the_first_event_is_the_response() -> None:
    event = f"data: {json.dumps(ERROR)}\n\n".encode()
    sent = await _through({"type": "http.response.start", "status": 200, "headers": SSE}, _body(event),
                          _body(b"data: [DONE]\n\n"), _body(b"", more=False))  # fmt: skip
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    start, body = sent
    headers = dict(start["headers"])
    assert start["status"] == 400 and headers[b"content-type"] == b"application/json"
    assert headers[b"x-request-id"] == b"abc" and int(headers[b"content-length"]) == len(body["body"])
    assert json.loads(body["body"]) == ERROR and body["more_body"] is False


async def test_a_stream_that_starts_with_output_goes_out_unchanged() -> None:
    start = {"type": "http.response.start", "status": 200, "headers": SSE}
    later_error = _body(f"data: {json.dumps(ERROR)}\n\n".encode())
    messages = [start, _body(b""), _body(b'data: {"choices": []}\n\n'), later_error, _body(b"", more=False)]
    sent = await _through(*messages)
    assert sent == [start, *messages[2:]]  # the empty chunk waited with the start; a later error event stays an event


async def test_other_responses_pass_at_once() -> None:
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    assert await _through(start) == [start]
    refused = {"type": "http.response.start", "status": 503, "headers": SSE}
    assert await _through(refused) == [refused]


@pytest.mark.parametrize(
    "chunk",
    [b'data: {"error": {"code": 200}}\n\n', b'data: {"error": "text"}\n\n', b"data: [DONE]\n\n", b"event: error\n",
     b'data: {"error": {"code": "x"}}\n\n', b'data: {"id": 1}\n\n'],
)  # fmt: skip
def test_only_an_error_event_with_an_error_status_counts(chunk: bytes) -> None:
    assert error_of(chunk) is None
