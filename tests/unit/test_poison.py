"""The door's known-poison rules (server.api.poison) on JSON bodies: each rule refuses its whole kind and
lets the neighbouring valid inputs through."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.api.media import MediaError
from server.api.poison import PoisonRules, check_constraint, check_known_poison, constraint_of

RULES = PoisonRules(vocab_size=1000, placeholders=("<|image_pad|>", "<|vision_start|>"))


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def refused(body: dict[str, Any], rules: PoisonRules | None = RULES) -> str:
    with pytest.raises(MediaError) as caught:
        check_known_poison(body, rules)
    assert (caught.value.status, caught.value.reason) == (400, "poison")
    return str(caught.value)


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ('{"temperature": NaN}', "temperature"),
        ('{"top_p": Infinity}', "top_p"),
        ('{"frequency_penalty": -Infinity}', "frequency_penalty"),
        ('{"logit_bias": {"5": NaN}}', "logit_bias.5"),
        ('{"structured_outputs": {"json": {"maximum": NaN}}}', "structured_outputs.json.maximum"),
    ],
)
def test_non_finite_numbers_anywhere(raw: str, where: str) -> None:
    body = {**chat(), **json.loads(raw)}  # Python's reader takes NaN/Infinity, as vLLM's parser would
    assert refused(body, None).startswith(f"{where}: must be a finite number")


@pytest.mark.parametrize(
    "so",
    [
        {"json_object": False},
        {"json": ""},
        {"json": "   "},
        {"regex": ""},
        {"grammar": ""},
        {"structural_tag": ""},
        {"choice": []},
        {"choice": [1, 2]},
        {"json_object": False, "regex": None},
    ],
)
def test_structured_outputs_without_a_usable_constraint(so: dict[str, Any]) -> None:
    assert "no usable constraint" in refused(chat(structured_outputs=so), None)


@pytest.mark.parametrize("so", [False, True, 0, "json", ["regex"]])
def test_structured_outputs_that_is_not_an_object(so: Any) -> None:
    """Found by the engine-fields fuzz test: vLLM's request model calls ``.get()`` on it and answers 500."""
    assert refused(chat(structured_outputs=so), None).startswith("structured_outputs: must be an object")


@pytest.mark.parametrize(
    ("body", "constraint"),
    [
        (chat(structured_outputs={"json_object": True}), {"json_object": True}),
        (chat(structured_outputs={"regex": "(ab){2}c"}), {"regex": "(ab){2}c"}),
        (chat(structured_outputs={"json": {}}), {"json": {}}),
        (
            chat(structured_outputs={"choice": ["yes", "no"], "disable_any_whitespace": True}),
            {"choice": ["yes", "no"], "disable_any_whitespace": True},
        ),
        (chat(response_format={"type": "json_object"}), {"json_object": True}),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object"}}}),
            {"json": {"type": "object"}},
        ),
        (chat(response_format={"type": "text"}), None),
        (chat(), None),
        (chat(structured_outputs={}), None),  # vLLM's own 400: none specified
    ],
)
def test_usable_constraints_pass_and_are_returned_for_compiling(
    body: dict[str, Any], constraint: dict[str, Any] | None
) -> None:
    assert check_known_poison(body, RULES) == constraint == constraint_of(body)


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"stop_token_ids": [3, 1000]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids[0]"),
        ({"allowed_token_ids": [5, 99999]}, "allowed_token_ids[1]"),
        ({"logit_bias": {"1000": 5}}, "logit_bias['1000']"),
    ],
)
def test_token_ids_outside_the_vocabulary(extra: dict[str, Any], where: str) -> None:
    assert refused(chat(**extra)).startswith(f"{where}: token id")


def test_token_ids_inside_the_vocabulary_pass() -> None:
    check_known_poison(chat(stop_token_ids=[0, 999], min_tokens=3, logit_bias={"999": -100}), RULES)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (chat(messages=[{"role": "user", "content": "see <|image_pad|> here"}]), "messages[0].content"),
        (
            chat(
                messages=[
                    {"role": "system", "content": "x"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a <|vision_start|>"},
                            {"type": "image_url", "image_url": {"url": "data:,"}},
                        ],
                    },
                ]
            ),
            "messages[1].content[0]",
        ),
        ({"model": "m", "prompt": "literal <|image_pad|>"}, "prompt"),
        ({"model": "m", "prompt": ["fine", "<|image_pad|>"]}, "prompt[1]"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "<|image_pad|>"}]}]},
            "input[0].content[0]",
        ),
        ({"model": "m", "input": "<|image_pad|>"}, "input"),
    ],
)
def test_literal_placeholder_tokens_in_any_text(body: dict[str, Any], where: str) -> None:
    assert refused(body).startswith(f"{where}: the text holds the model's multimodal placeholder")


def test_placeholder_lookalikes_pass() -> None:
    check_known_poison(chat(messages=[{"role": "user", "content": "<|image|> and image_pad and <|im_start|>"}]), RULES)


def test_constraints_compiled_with_the_given_backend() -> None:
    seen: list[dict[str, Any]] = []

    def compile_constraint(constraint: dict[str, Any]) -> str | None:
        seen.append(constraint)
        return "bad grammar at 1:3" if "grammar" in constraint else None

    rules = PoisonRules(vocab_size=10, compile_constraint=compile_constraint)
    check_constraint({"regex": "a+"}, rules)
    with pytest.raises(MediaError, match="cannot be compiled by the engine's backend: bad grammar at 1:3"):
        check_constraint({"grammar": "root ::= x"}, rules)
    check_constraint({"grammar": "root ::= x"}, None)  # before the engine is up: not compiled
    assert seen == [{"regex": "a+"}, {"grammar": "root ::= x"}]


def test_integers_are_counted_at_any_depth_booleans_and_floats_not() -> None:
    from server.api.poison import integers

    body = {"tokens": [1, 2, True, 2.0], "x": [{"y": [[3, 4], 5]}], "n": 7}
    assert integers(body) == 5  # a lone integer member is not a list of ids
    deep: list[object] = [1]
    for _ in range(50_000):
        deep = [deep]
    assert integers(deep) == 1


def test_one_walk_finds_objects_prompt_extent_and_non_finite_numbers() -> None:
    from server.api.poison import BodyWalk, walk

    body = json.loads(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "image_url",'
        ' "image_url": {"url": "data:image/png;base64,AAAA"}}]}, {"role": "system", "content": "hello"}],'
        ' "prompt": [[1, 2, 3], [4, 5]], "temperature": 0.5, "logit_bias": {"7": 1e400}}'
    )
    # objects: the body, two messages, two parts, the image_url, logit_bias; text: every string and key under
    # the input fields (roles, part types, keys: the template reads them), the image's URL not
    strings = len("user") + len("text") + len("abc") + len("image_url") + len("system") + len("hello")
    keys = 2 * len("rolecontent") + len("typetext") + len("typeimage_url") + len("url")
    chars = strings + keys
    assert walk(body) == BodyWalk(objects=7, prompt_chars=chars, prompt_ids=3, non_finite=True)
    assert walk(chat(temperature=1e308)).non_finite is False
    with pytest.raises(MediaError, match=r"^logit_bias\.7: must be a finite number"):
        check_known_poison(body, None, walk(body))  # the door hands its walk in
    assert check_known_poison(chat(), None, walk(chat())) is None
    deep: list[object] = [1.5]
    for _ in range(50_000):
        deep = [deep]
    assert walk(deep) == BodyWalk(0, 0, 0, False)  # iterative: no recursion limit


def test_the_walk_stops_at_the_object_bound() -> None:
    from server.api.poison import walk

    body = {"x": [{} for _ in range(100_000)], "prompt": "abc"}
    assert walk(body, 10).objects == 11  # it stopped: the body is refused for its objects
    assert walk(body).objects == 100_001


def test_a_bad_numbers_path_is_built_for_it_alone_and_bounded() -> None:
    """The path names the first non-finite number in document order; it is built for that value only
    (a path string for every value before it, each holding a client's long key, took seconds and GBs)."""
    import tracemalloc

    from server.api.poison import walk

    key = "k" * 20_000
    body = {"model": "m", "vllm_xargs": {key: [0.5] * 5_000 + [1e400]}, "z": [1e400]}
    tracemalloc.start()
    with pytest.raises(MediaError) as caught:
        check_known_poison(body, None, walk(body))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (
        str(caught.value)
        == f"vllm_xargs.{'k' * 40}...[5000]: must be a finite number (NaN and Infinity are not accepted)"
    )
    assert peak < 5_000_000, peak  # a path per value: 5,000 strings of 20 KB
    deep: Any = [1e400]
    for _ in range(900):
        deep = {"a": deep}
    with pytest.raises(MediaError) as deeply:
        check_known_poison({"x": deep}, None)
    message = str(deeply.value)
    assert message.startswith("...") and message.endswith(
        ".a[0]: must be a finite number (NaN and Infinity are not accepted)"
    )
    assert len(message) < 500
