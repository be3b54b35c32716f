"""Inputs known to fault vLLM's engine, refused at the door with 400 before the engine sees them.

Each rule refuses a whole kind of input, not one payload, and names the upstream defect it stands in for.
The rules read the parsed JSON body of a generation request (``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses``) and the served model's facts (:class:`PoisonRules`, known once
the engine is up):

- non-finite numbers anywhere in the body: ``NaN`` and ``Infinity`` are refused while the door parses
  (:func:`server.api.input_guard._parse_json`; Python's JSON reader takes them), a literal that overflows to
  infinity (``1e999``) by :func:`check_numbers`: sampling with a NaN temperature or penalty gave garbage,
  slowly;
- ``structured_outputs`` with no usable constraint (``json_object: false``, ``json: ""``, an empty
  ``regex``/``grammar``/``structural_tag``, ``choice: []``): the engine core's grammar compiler raised
  inside ``schedule()`` and the engine died (the fault class of vllm#43920, fixed by vllm PR #47312);
- a constraint the engine's structured-output backend cannot compile (``response_format`` JSON schemas
  included): the same, for schemas and grammars that pass vLLM's API-side validation (with ``auto`` that
  falls back to guidance per request while the engine compiles with the backend it latched; vllm#43920,
  PRs #45346 and #47312);
- token ids outside the vocabulary (``stop_token_ids``, ``allowed_token_ids``, ``logit_bias`` keys): an
  out-of-vocabulary stop token with ``min_tokens`` indexed past the logits in the model step (vllm#54195);
- literal multimodal placeholder tokens (``<|image_pad|>``, ``<|vision_start|>``, ...) in text: the image
  bound to the user's literal placeholder, silently (vllm#57740).

``truncate_prompt_tokens`` that cuts into an image's placeholder (vllm#57038) is known only once the
prompt is rendered: :mod:`server.api.errors` answers vLLM's failed prompt replacement with 400.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from server.api.media import MediaError

#: The constraint fields of ``structured_outputs`` (vLLM's ``StructuredOutputsParams``).
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

#: ``(constraint kwargs) -> error message or None``: compiles the constraint with the engine's backend.
ConstraintCompiler = Callable[[dict[str, Any]], str | None]


@dataclass(frozen=True)
class PoisonRules:
    """What the door needs to know of the served model.

    Attributes:
        vocab_size: the model's vocabulary size (token ids are ``0 .. vocab_size - 1``).
        placeholders: the tokenizer's multimodal placeholder strings (``<|image_pad|>``, ...).
        compile_constraint: checks a structured-output constraint with the engine's backend; None: not
            checked (a backend vlguard does not know).
        max_prompt_chars: ``max_model_len`` times the longest token's length in characters: a prompt whose
            text is longer cannot fit in the context (every token covers at most that many characters), so
            it is refused before it is tokenized. None: not known.
        max_model_len: the model's context in tokens. None: not known.
    """

    vocab_size: int
    placeholders: tuple[str, ...] = ()
    compile_constraint: ConstraintCompiler | None = None
    max_prompt_chars: int | None = None
    max_model_len: int | None = None


#: Keys whose string values (and lists of strings) are prompt text, in every request shape of vLLM's routes.
TEXT_KEYS = frozenset({"prompt", "text", "content", "input", "system", "instructions"})
#: Top-level fields that are the request's input: every string under them (roles, names, tool definitions,
#: template arguments, and the keys of their objects) may reach the chat template or the tokenizer, so all
#: count as prompt text but media. (A top-level ``text`` is the Responses output format, not input.)
INPUT_KEYS = frozenset({"prompt", "input", "system", "instructions", "messages", "tools", "functions", "tool_choice",
                        "chat_template_kwargs", "documents"})  # fmt: skip
#: Keys under which a string (not an object: a tool may name a property ``url``) is media or embeddings (a
#: URL, a data URI, base64 data or tensors), not text:
#: bounded by the media checks, the body's size and vLLM's own flags (``--enable-prompt-embeds``).
MEDIA_KEYS = frozenset({"url", "data", "file_data", "image_url", "video_url", "audio_url", "image",
                        "image_embeds", "audio_embeds", "prompt_embeds"})  # fmt: skip


def _refuse(message: str, reason: str = "poison") -> MediaError:
    """A 400 refusal (``vlguard_requests_rejected_total{reason}``)."""
    return MediaError(HTTPStatus.BAD_REQUEST, message, reason=reason)


@dataclass(frozen=True, slots=True)
class BodyWalk:
    """What one walk of a parsed JSON body finds (:func:`walk`).

    Attributes:
        objects: JSON objects (dicts) at any depth.
        prompt_chars: characters of the strings, and of the objects' keys, under :data:`INPUT_KEYS` (at the
            top) and :data:`TEXT_KEYS` (anywhere), but media (strings under :data:`MEDIA_KEYS`).
        prompt_ids: the length of the longest list of token ids there (a completions ``prompt``, or one of
            a batch).
        non_finite: a float that is not finite is somewhere (a literal such as ``1e999`` parses as one).
    """

    objects: int
    prompt_chars: int
    prompt_ids: int
    non_finite: bool


def walk(body: Any, max_objects: int | None = None) -> BodyWalk:
    """Walk a parsed JSON body once for every bound the door reads from the whole of it (iterative: a deep
    body cannot exhaust the stack; O(values), which the door bounds before parsing). With ``max_objects``,
    the walk stops at the first object past it (``objects`` is then ``max_objects + 1`` and the rest is
    not counted: the body is refused for its objects)."""
    objects = chars = longest = 0
    non_finite = False
    stack: list[tuple[Any, bool]] = [(body, False)]
    top = True
    while stack:
        value, is_text = stack.pop()
        kind = type(value)  # a parsed body holds exactly these types
        if kind is str:
            chars += len(value) if is_text else 0
        elif kind is dict:
            objects += 1
            if max_objects is not None and objects > max_objects:
                break
            keys = INPUT_KEYS if top else TEXT_KEYS
            if is_text:
                chars += sum(map(len, value))
            stack += [(item, (is_text or key in keys) and not (key in MEDIA_KEYS and type(item) is str))
                      for key, item in value.items()]  # fmt: skip
            top = False
        elif kind is list:
            if is_text and value and all(type(item) is int for item in value):
                longest = max(longest, len(value))
            else:
                stack += [(item, is_text) for item in value]
        elif kind is float and not math.isfinite(value):
            non_finite = True
    return BodyWalk(objects, chars, longest, non_finite)


def check_prompt_length(walked: BodyWalk, rules: PoisonRules | None) -> None:
    """Refuse a prompt that cannot fit the model's context, before anything tokenizes or validates it: text
    longer than :attr:`PoisonRules.max_prompt_chars`, or a prompt of more token ids than ``max_model_len``
    (990,000 ids to ``/v1/completions`` held the event loop 133 ms in vLLM's validation before its 400).

    Raises:
        MediaError: 400 naming the length and the bound.
    """
    if rules is None:
        return
    chars, ids = walked.prompt_chars, walked.prompt_ids
    if rules.max_prompt_chars is not None and chars > rules.max_prompt_chars:
        raise _refuse(
            f"prompt text of {chars} characters cannot fit the model's context (at most {rules.max_prompt_chars} "
            "characters: max_model_len tokens of the longest token's length)",
            reason="prompt_too_long",
        )
    if rules.max_model_len is not None and ids > rules.max_model_len:
        raise _refuse(
            f"a prompt of {ids} token ids cannot fit the model's context of {rules.max_model_len} tokens",
            reason="prompt_too_long",
        )


def integers(body: Any) -> int:
    """How many JSON integers ``body`` holds, at any depth (iterative: a deep body cannot exhaust the stack)."""
    stack, found = [body], 0
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            found += sum(1 for item in value if type(item) is int)
            stack.extend(item for item in value if isinstance(item, (dict, list)))
    return found


def check_token_count(body: Any, rules: PoisonRules | None, max_sequences: int) -> None:
    """Refuse a body that takes no prompt (``/detokenize``, the derender routes) but carries more token ids
    than the outputs of one request can hold: ``max_sequences`` sequences of ``max_model_len`` tokens. Such a
    route turns each id into text on the event loop (20 million ids to ``/detokenize`` held it 4-5 s and grew
    the process by 2.2 GB; every integer is counted, as each route nests its ids differently).

    Raises:
        MediaError: 400 naming the count and the bound.
    """
    if rules is None or rules.max_model_len is None:
        return
    bound = rules.max_model_len * max_sequences
    if (found := integers(body)) > bound:
        raise _refuse(
            f"the request holds {found} token ids, more than {bound} ({max_sequences} sequences of the model's "
            f"{rules.max_model_len} tokens): send fewer",
            reason="too_many_tokens",
        )


def sequences(body: dict[str, Any]) -> int:
    """The sequences a generation body asks for: ``n`` (or ``best_of``, the larger) times its prompts (a
    completions ``prompt`` list of strings or of token-id lists is a batch; a list of token ids is one)."""
    asked = [v for v in (body.get("n"), body.get("best_of")) if isinstance(v, int) and not isinstance(v, bool)]
    per_prompt = max([1, *asked])
    prompt = body.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return per_prompt * batch


def check_sequences(body: dict[str, Any], max_sequences: int) -> None:
    """Refuse a generation request that asks for more than ``max_sequences`` sequences (:func:`sequences`).

    Raises:
        MediaError: 400 naming the count and the bound.
    """
    if (asked := sequences(body)) > max_sequences:
        raise _refuse(
            f"the request asks for {asked} sequences (n or best_of, times the prompts of a batch), more than "
            f"this server's limit of {max_sequences} per request: send fewer, or several requests",
            reason="too_many_sequences",
        )


#: How much of a key, and of the whole path, a refusal shows (keys are the client's: one may be the whole
#: body; a path may be 990 levels deep)
_KEY_SHOWN, _PATH_SHOWN = 40, 400


def _first_non_finite(body: Any) -> str | None:
    """The path (``logit_bias.5``, ``messages[0].content[1].x``) of the first non-finite float in ``body``
    in document order, or None. Iterative, and the path is built for that one value only, from the keys
    and indices on the way to it (each key cut to :data:`_KEY_SHOWN` characters): O(values) however long
    the keys and however deep the body."""
    stack: list[tuple[Any, int]] = [(body, -1)]  # (value, its step in ``steps``)
    steps: list[tuple[int, str]] = []  # (parent step, "key" or "[i]")
    while stack:
        value, step = stack.pop()
        kind = type(value)
        if kind is float and not math.isfinite(value):
            parts = []
            while step >= 0:
                step, part = steps[step]
                parts.append(part)
            path = "".join(reversed(parts)).removeprefix(".")
            return path if len(path) <= _PATH_SHOWN else "..." + path[-_PATH_SHOWN:]
        if kind is not dict and kind is not list:
            continue
        # Only what can hold a bad number is kept and named: a scalar costs no path part
        kept = [(at, item) for at, item in (value.items() if kind is dict else enumerate(value))
                if type(item) in (dict, list, float)]  # fmt: skip
        for at, item in reversed(kept):  # popped in document order
            steps.append(
                (step, f"[{at}]" if kind is list else f".{at[:_KEY_SHOWN]}{'...' if len(at) > _KEY_SHOWN else ''}")
            )
            stack.append((item, len(steps) - 1))
    return None


def check_numbers(body: dict[str, Any], walked: BodyWalk | None = None) -> None:
    """Raises:
    MediaError: 400 naming the first ``NaN``/``Infinity`` in the body (the body's parser refuses their
        literals; a float literal too large for a double, ``1e400``, parses as one). ``walked``: the body's
        :func:`walk`, when the caller has it (the body is walked here only when it holds one)."""
    if not (walked or walk(body)).non_finite:
        return
    if (where := _first_non_finite(body)) is not None:
        raise _refuse(f"{where}: must be a finite number (NaN and Infinity are not accepted)")


def _usable(name: str, value: Any) -> bool:
    if name == "json_object":
        return value is True
    if name == "choice":
        return isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value)
    if name == "json":
        return isinstance(value, dict) or (isinstance(value, str) and bool(value.strip()))
    return isinstance(value, str) and bool(value)


def constraint_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The structured-output constraint a request asks for, as ``StructuredOutputsParams`` keyword
    arguments: its ``structured_outputs`` (constraint fields only, None dropped), or its
    ``response_format`` (``json_schema``: ``json``; ``json_object``: ``json_object``); None when it asks
    for none.

    Raises:
        MediaError: 400 when ``structured_outputs`` is not an object (vLLM's request model answers 500) or
            names no usable constraint.
    """
    found = body.get("structured_outputs")
    if found is not None and not isinstance(found, dict):  # vLLM's before-validator calls .get(): a 500
        raise _refuse(f"structured_outputs: must be an object, not {type(found).__name__}")
    if isinstance(found, dict):
        given = {k: found[k] for k in CONSTRAINTS if found.get(k) is not None}
        if not given:
            return None  # vLLM refuses "none are specified" itself
        if not any(_usable(k, v) for k, v in given.items()):
            fields = ", ".join(f"{k}={json.dumps(v)[:40]}" for k, v in given.items())
            raise _refuse(
                f"structured_outputs: no usable constraint ({fields}): json_object must be true; json, regex, "
                "grammar and structural_tag non-empty; choice a non-empty list of strings"
            )
        options = {k: found[k] for k in ("disable_any_whitespace", "disable_additional_properties") if k in found}
        return {**given, **options}
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        if response_format.get("type") == "json_object":
            return {"json_object": True}
        schema = response_format.get("json_schema")
        if response_format.get("type") == "json_schema" and isinstance(schema, dict):
            inner = schema.get("schema", schema.get("json_schema"))
            if isinstance(inner, dict | str):
                return {"json": inner}
    return None


def check_token_ids(body: dict[str, Any], vocab_size: int) -> None:
    """Raises:
    MediaError: 400 naming a token id outside ``0 .. vocab_size - 1`` (vllm#54195)."""

    def ids(key: str) -> Iterator[tuple[str, Any]]:
        value = body.get(key)
        if isinstance(value, list):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict) and key == "logit_bias":
            yield from ((f"{key}[{k!r}]", k) for k in value)

    for key in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        for where, raw in ids(key):
            try:
                token = int(raw)
            except (TypeError, ValueError):
                continue  # vLLM's own validation names a non-integer
            if not 0 <= token < vocab_size:
                raise _refuse(f"{where}: token id {token} is outside the vocabulary (0 to {vocab_size - 1})")


def _texts(body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Every text a client wrote: chat and responses message contents and text parts, completion prompts."""
    for key in ("messages", "input"):
        turns = body.get(key)
        if isinstance(turns, str):
            yield key, turns
        if not isinstance(turns, list):
            continue
        for i, turn in enumerate(turns):
            content = turn.get("content") if isinstance(turn, dict) else None
            if isinstance(content, str):
                yield f"{key}[{i}].content", content
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    if isinstance(part, dict) and isinstance(text := part.get("text"), str):
                        yield f"{key}[{i}].content[{j}]", text
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield "prompt", prompt
    elif isinstance(prompt, list):
        yield from ((f"prompt[{i}]", p) for i, p in enumerate(prompt) if isinstance(p, str))


def check_placeholders(body: dict[str, Any], placeholders: tuple[str, ...]) -> None:
    """Raises:
    MediaError: 400 naming the text that holds a literal multimodal placeholder token (vllm#57740)."""
    if not placeholders:
        return
    for where, text in _texts(body):
        for token in placeholders:
            if token in text:
                raise _refuse(
                    f"{where}: the text holds the model's multimodal placeholder {token}; send images as "
                    "image parts, not as placeholder tokens"
                )


def check_known_poison(
    body: dict[str, Any], rules: PoisonRules | None, walked: BodyWalk | None = None
) -> dict[str, Any] | None:
    """Apply every rule that needs no engine (see the module docstring).

    Arguments:
        body: the parsed JSON body (a dict).
        rules: the served model's facts; None before the engine is up (then only the model-free rules).
        walked: the body's :func:`walk`, when the caller has it.

    Returns:
        The request's structured-output constraint (for :func:`check_constraint`), or None.

    Raises:
        MediaError: 400 (``reason="poison"``) naming the refused field.
    """
    check_numbers(body, walked)
    constraint = constraint_of(body)
    if rules is not None:
        check_token_ids(body, rules.vocab_size)
        check_placeholders(body, rules.placeholders)
    return constraint


def check_constraint(constraint: dict[str, Any], rules: PoisonRules | None) -> None:
    """Compile ``constraint`` with the engine's backend (blocking: run it off the event loop).

    Raises:
        MediaError: 400 with the backend's error when it cannot compile the constraint.
    """
    if rules is None or rules.compile_constraint is None:
        return
    if (error := rules.compile_constraint(constraint)) is not None:
        raise _refuse(f"structured output constraint cannot be compiled by the engine's backend: {error[:500]}")
