"""Detect, by behaviour rather than version strings, which deepstack defects a model class still has.

Each probe calls the class's own (unbound) method on a small stand-in object that carries only the
buffer state the method reads, on CPU, with tiny tensors. A probe that cannot run (the installed code
reads other attributes: a later vLLM with a different buffer layout) reports the defect as absent, so
unknown code is never patched.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from server.patches.deepstack import CLEAR, EMPTY_BUFFER, GET, PADDED_READ

logger = logging.getLogger("vllm.vlguard.patches")  # runs inside vLLM processes: use its handler

_LEVELS, _CAPACITY, _HIDDEN = 2, 8, 4


def _stand_in(written: int) -> SimpleNamespace:
    return SimpleNamespace(
        deepstack_input_embeds=[torch.zeros(_CAPACITY, _HIDDEN) for _ in range(_LEVELS)],
        deepstack_input_embeds_num_tokens=written,
        deepstack_num_level=_LEVELS,
        use_deepstack=True,
        config=SimpleNamespace(text_config=SimpleNamespace(hidden_size=_HIDDEN)),
    )


def _call(cls: type, method: str, written: int, num_tokens: int) -> tuple[str, Any]:
    """``("ok", result)``, ``("value_error", exc)`` or ``("unknown", exc)``."""
    try:
        return "ok", getattr(cls, method)(_stand_in(written), num_tokens)
    except ValueError as exc:
        return "value_error", exc
    except Exception as exc:
        return "unknown", exc


def has_padded_read_defect(cls: type) -> bool:
    """A read or clear of more rows than were written raises ``ValueError`` (vLLM 0.20.0)."""
    results = [_call(cls, GET, 2, 4)[0], _call(cls, CLEAR, 2, 4)[0]]
    return "value_error" in results


def has_empty_buffer_defect(cls: type) -> bool:
    """A read of an empty buffer returns ``None`` instead of zero tensors (vLLM 0.20.0 - 0.22.x)."""
    outcome, result = _call(cls, GET, 0, 4)
    return outcome == "ok" and result is None


def defects(cls: type) -> list[str]:
    """The patch names ``cls`` needs, in a stable order (empty when upstream already fixed both)."""
    if not all(callable(getattr(cls, m, None)) for m in (GET, CLEAR)):
        return []
    found = []
    if has_padded_read_defect(cls):
        found.append(PADDED_READ)
    if has_empty_buffer_defect(cls):
        found.append(EMPTY_BUFFER)
    return found
