"""Validation errors become short OpenAI-envelope messages that name the field."""

from __future__ import annotations

from typing import Any

import pytest

from server.api.errors import detail_message, validation_message


def test_missing_field_names_it() -> None:
    errors = [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required", "input": {}}]
    assert validation_message(errors) == ("messages: Field required", "messages")


def test_invalid_json_has_no_param() -> None:
    errors = [
        {"type": "json_invalid", "loc": ("body", 10), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}
    ]
    assert validation_message(errors) == ("body: JSON decode error: Expecting value", None)


def test_nested_location_is_dotted() -> None:
    errors = [{"type": "int_parsing", "loc": ("body", "messages", 0, "content"), "msg": "bad"}]
    assert validation_message(errors) == ("messages.0.content: bad", "messages")


@pytest.mark.parametrize(
    ("errors", "expected"),
    [
        (["Unsupported Media Type: Only 'application/json' is allowed"], ("Unsupported Media Type: Only", None)),
        ("one plain string", ("one plain string", None)),
        ({"loc": "messages", "msg": "bad"}, ("messages: bad", "messages")),  # one dict, a string location
        ([{"msg": "no location"}], ("no location", None)),
        ([{"loc": None, "msg": "x", "ctx": "not a dict", "type": "json_invalid"}], ("x", None)),
        ([["nested", "list"]], ("['nested', 'list']", None)),
        ([42, None], ("42; None", None)),
        ([], ("invalid request", None)),
    ],
)
def test_every_error_shape_gives_a_message(errors: Any, expected: tuple[str, str | None]) -> None:
    message, param = validation_message(errors)
    assert message.startswith(expected[0]) and param == expected[1]


@pytest.mark.parametrize(
    ("detail", "expected"),
    [("Not Found", "Not Found"), ({"message": "gone"}, "gone"), ({"a": 1}, '{"a": 1}'),
     ([{"loc": ["x"], "msg": "bad"}], "x: bad"), (None, "null")],
)  # fmt: skip
def test_every_http_exception_detail_gives_a_message(detail: Any, expected: str) -> None:
    assert detail_message(detail) == expected


def test_a_refusal_names_at_most_twenty_errors_each_cut() -> None:
    """A list of bad items against a union of item types gives ~60 errors an item: the message stays
    bounded (a 6 KB body to /v1/responses was answered with a 218 MB message)."""
    errors = [{"loc": ("body", "input", i), "msg": "x" * 2000} for i in range(100)]
    message, param = validation_message(errors)
    assert param == "input" and message.endswith("(and 80 more errors)")
    assert message.count("input.") == 20 and len(message) < 20 * 520


def test_a_long_access_log_line_is_cut_and_still_written_by_uvicorns_formatter() -> None:
    """Hostile review: the cut set an access record's arguments to None, and uvicorn's access formatter unpacks
    them: a 9,000-character path logged a 110-line "Logging error" traceback per request instead of its line."""
    import io
    import logging

    from uvicorn.logging import AccessFormatter

    from server.api.errors import MAX_LOG_CHARS, LongMessageCut

    written = io.StringIO()
    handler = logging.StreamHandler(written)
    handler.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s'))
    handler.addFilter(LongMessageCut())
    log = logging.getLogger("test.uvicorn.access")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        log.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/" + "x" * 20_000, "1.1", 404)
    finally:
        log.removeHandler(handler)
    line = written.getvalue()
    assert line.count("\n") == 1 and "Logging error" not in line
    assert "more characters cut" in line and " 404" in line and len(line) < MAX_LOG_CHARS
