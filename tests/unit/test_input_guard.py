"""The door's JSON parse (:func:`server.api.input_guard._parse_json`): pydantic's fast parser, and for
whatever it refuses the standard library's result, which is what vLLM's own parser sees."""

from __future__ import annotations

import json

import pytest

from server.api.input_guard import _MALFORMED, _parse_json
from server.api.media import MediaError

SAME_AS_JSON = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}',
    b"[" * 300 + b"]" * 300,  # deeper than pydantic's limit (200), well within json's
    b'{"content": "\\ud800 lone surrogate"}',  # pydantic refuses it
    '{"content": "utf-16"}'.encode("utf-16"),  # json detects the encoding
    b'{"temperature": 1e999, "n": 123456789012345678901234567890}',  # overflow: inf (refused later, by the walk)
    b'{"a": 1, "a": 2}',  # the last key wins in both
    b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte-order mark: pydantic refuses it
    b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8 bytes: pydantic refuses it, json keeps it
]


@pytest.mark.parametrize("raw", SAME_AS_JSON, ids=range(len(SAME_AS_JSON)))
def test_the_parse_equals_the_standard_library(raw: bytes) -> None:
    expected, got = json.loads(raw), _parse_json(raw)
    assert json.dumps(got) == json.dumps(expected)


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe\x00", b'{"a": 1,}', b"[1] x"])
def test_malformed_json_is_left_to_vllm(raw: bytes) -> None:
    assert _parse_json(raw) is _MALFORMED


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_constants_are_refused_while_parsing(constant: bytes) -> None:
    """#44: refused by the parse itself (vLLM's parser takes them), not by a second walk of the body."""
    with pytest.raises(MediaError, match="is not a finite JSON number"):
        _parse_json(b'{"a": [1, {"b": ' + constant + b"}]}")


def test_json_too_deep_for_the_standard_library_is_a_400() -> None:
    with pytest.raises(MediaError) as err:
        _parse_json(b"[" * 100_000 + b"]" * 100_000)
    assert err.value.status == 400
