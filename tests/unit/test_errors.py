"""Validation errors become short OpenAI-envelope messages that name the field."""

from __future__ import annotations

from server.api.errors import validation_message


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
