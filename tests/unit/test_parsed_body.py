"""The door's parse handed to vLLM's route (:mod:`server.api.parsed_body`): it is ``json.loads``'s, value for
value, wherever the door lets a body through, and a route takes it only for the very bytes it was made of."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from server.api.input_guard import _MALFORMED, _parse_json
from server.api.media import MediaError
from server.api.parsed_body import drop, hand_over, install

#: Bodies where JSON parsers are known to part ways: duplicate keys, numbers at the edges of a float, big
#: integers, surrogates, control characters, byte-order marks, bad UTF-8, trailing bytes, constants.
TRICKY = [
    b'{"a":1,"b":0,"a":2}', b'{"a":1e400}', b'{"a":-1e400}', b'{"a":1e-400}', b'{"a":-0}', b'{"a":-0.0}',
    b'{"a":12345678901234567890123456789}', b'{"a":9007199254740993}', b'{"a":1.7976931348623157e308}',
    b'{"a":1.0000000000000002}', b'{"a":123456789.123456789e-5}', b'{"a":5e-324}', b'{"a":1E+2}', b'{"a":01}',
    b'{"a":1.}', b'{"a":.5}', b'{"a":-}', b'{"a":"x\ty"}', b'{"a":"\x00"}', b'{"a":"x\x1fy"}', b'{"a":"\x7f"}',
    b'{"a":"\xff"}', b'{"a":"\xc0\x80"}', b'{"a":"\xed\xa0\x80"}', b'{"a":"\xf4\x90\x80\x80"}', b'{"a":"\\ud800"}',
    b'{"a":"\\ud83d\\ude00"}', b'{"\\u0061":1,"a":2}', b'{"a":"\\/"}', b'\xef\xbb\xbf{"a":1}', b' {"a":1} \n',
    b'\t{"a":1}\r', b'{"a":1}\x0c', b'{"a":1}\xa0', b'{"a":1} x', b'{"a":1}\x00', b'{"a":[1,2,]}', b'{"a":tru}',
    b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}', b'[1,"2",null]', b'"text"', b'null', b"",
    '{"a":"é😀"}'.encode("utf-16"), '{"a":1}'.encode("utf-32"), b"[" * 300 + b"]" * 300,
]  # fmt: skip


def _door_parse(raw: bytes) -> Any:
    try:
        return _parse_json(raw)
    except MediaError:
        return _MALFORMED  # refused at the door: nothing handed over


def _same(raw: bytes) -> None:
    parsed = _door_parse(raw)
    if parsed is _MALFORMED:
        return
    stock = json.loads(raw)
    assert parsed == stock or repr(parsed) == repr(stock), raw  # nan != nan: the repr then
    assert repr(parsed) == repr(stock), raw  # key order and types too (1 vs 1.0, -0.0)


@pytest.mark.parametrize("raw", TRICKY, ids=range(len(TRICKY)))
def test_the_doors_parse_is_json_loads_wherever_it_lets_a_body_through(raw: bytes) -> None:
    _same(raw)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=JSON, ascii_only=st.booleans())
def test_the_doors_parse_is_json_loads_on_any_json(value: Any, ascii_only: bool) -> None:
    _same(json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=40) | st.builds(lambda a, b: a + b, st.sampled_from(TRICKY), st.binary(max_size=4)))
def test_the_doors_parse_is_json_loads_on_any_bytes(raw: bytes) -> None:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        assert _door_parse(raw) is _MALFORMED, raw  # never a parse where stock refuses
        return
    _same(raw)


def _request(scope: dict[str, Any], *chunks: bytes) -> Request:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": [], **scope}, receive)


async def test_a_route_takes_the_parse_handed_over_for_its_bytes() -> None:
    install()
    raw, parsed = b'{"a": [1, 2]}', {"a": [1, 2]}
    assert await _request(hand_over({}, raw, parsed), raw).json() is parsed


async def test_other_bytes_are_parsed_as_stock_parses_them() -> None:
    install()
    raw, parsed = b'{"a": [1, 2]}', {"a": [1, 2]}
    assert await _request(hand_over({}, raw, parsed), raw[:5], raw[5:]).json() is parsed  # chunks: same bytes
    for other in (b'{"a": 3}', b'{"a": [1, 2]} '):  # rewritten by a middleware
        assert await _request(hand_over({}, raw, parsed), other).json() == json.loads(other)
    assert await _request({}, raw).json() == parsed  # nothing handed over


async def test_each_reader_gets_a_parse_of_its_own() -> None:
    """Hostile review: a ``--middleware`` that read the body and the route shared the door's one parse, so
    what one changed the other saw (a middleware's redaction reached the engine; a vLLM validator's default
    reached the middleware). The first reader takes it; later readers parse the bytes, as stock."""
    install()
    raw, parsed = b'{"a": [1, 2]}', {"a": [1, 2]}
    scope = hand_over({}, raw, parsed)
    first = await _request(scope, raw).json()
    later = [await _request(scope, raw).json(), await _request({**scope}, raw).json()]  # a copied scope too
    assert first is parsed and all(p == parsed and p is not parsed for p in later)


async def test_a_dropped_parse_is_not_taken() -> None:
    install()
    raw, parsed = b'{"a": [1, 2]}', {"a": [1, 2]}
    scope = hand_over({}, raw, parsed)
    drop(scope)
    taken = await _request(scope, raw).json()
    assert taken == parsed and taken is not parsed
    drop({})  # nothing handed over: nothing to drop


def test_a_lower_integer_digit_limit_is_json_loads_too() -> None:
    """Hostile review: pydantic's parser takes integers up to 4300 digits whatever the interpreter's limit;
    with a lower one (``PYTHONINTMAXSTRDIGITS=640``) ``json.loads`` refuses what the door had parsed."""
    raw = b'{"a": ' + b"7" * 1000 + b"}"
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        with pytest.raises(ValueError):
            json.loads(raw)
        assert _door_parse(raw) is _MALFORMED
        assert _door_parse(b'{"a": ' + b"7" * 600 + b"}") == {"a": int("7" * 600)}
    finally:
        sys.set_int_max_str_digits(before)


def test_install_is_idempotent() -> None:
    install()
    first = Request.json
    install()
    assert Request.json is first
