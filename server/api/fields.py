"""Bounds on a request's fields beside its input: the work vLLM does item by item for them is the client's
to choose, so its size is bounded before anything reads them.

vLLM works through list-valued sampling fields one item at a time on the API process's event loop or in
every engine step: 500,000 ``bad_words`` (each tokenized) held ``/health`` 29 s, 900,000 ``stop`` strings
17 s, bounded only by the body's value count. Every field but the input (:data:`server.api.poison.
INPUT_KEYS`, bounded as prompt text and by the body's object count) and embeddings (``prompt_embeds``) is
held to :data:`MAX_ITEMS` items in any list or object at any depth, and all of their text together
(strings and object keys) to :data:`MAX_CHARS` characters: the stop strings, bad words, token-id lists,
``logit_bias``, structured-output constraints, ``vllm_xargs`` and whatever field a later vLLM adds. Past
either, 400 naming the field.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from server.api.media import MediaError
from server.api.poison import INPUT_KEYS

#: The one field beside the input that may be large: a completion's prompt embeddings (base64 tensors,
#: ``--enable-prompt-embeds``), bounded by the body's size.
EMBEDS = "prompt_embeds"

#: Items one list or object outside the input may hold (a stop list, bad words, ``logit_bias``, a choice).
MAX_ITEMS = 1024
#: Characters of text all fields outside the input may hold together (a grammar, a JSON schema, stop strings).
MAX_CHARS = 64 * 1024


def check_fields(body: dict[str, Any]) -> None:
    """Refuse a body whose fields beside the input run past :data:`MAX_ITEMS` or :data:`MAX_CHARS` (iterative;
    O(values), which the door bounds before parsing).

    Raises:
        MediaError: 400 naming the field.
    """
    if len(body) > MAX_ITEMS:
        raise _refuse(f"the request has {len(body)} fields; at most {MAX_ITEMS} are read")
    chars = 0
    for key, value in body.items():
        if key in INPUT_KEYS or key == EMBEDS:  # the input, or embeddings
            continue
        chars += len(key)
        stack = [value]
        while stack:
            item = stack.pop()
            kind = type(item)
            if kind is str:
                chars += len(item)
            elif kind is list or kind is dict:
                if len(item) > MAX_ITEMS:
                    raise _refuse(f"{key}: a list or object of {len(item)} items; at most {MAX_ITEMS}")
                if kind is dict:
                    chars += sum(len(k) for k in item)
                    stack.extend(item.values())
                else:
                    stack.extend(item)
            if chars > MAX_CHARS:
                raise _refuse(f"{key}: the request's fields beside its input hold over {MAX_CHARS} characters")


def _refuse(message: str) -> MediaError:
    return MediaError(HTTPStatus.BAD_REQUEST, message, reason="body")
