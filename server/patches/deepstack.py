"""Backport of the upstream fixes to Qwen3-VL's deepstack buffer, and its instrumentation.

Qwen3-VL-style models (``Qwen3VLForConditionalGeneration``, the Qwen3-Omni thinker, any class with
``_get_deepstack_input_embeds``) keep one buffer per deepstack level, shape
``[capacity_tokens, hidden_size]``. ``embed_input_ids`` writes the step's visual rows with the *scheduled*
token count (``_set_deepstack_input_embeds``); ``forward`` reads them with the *padded* token count
(``_get_deepstack_input_embeds``) and clears them afterwards (``_clear_deepstack_input_embeds``).

Defects in the installed vLLM, detected by :mod:`server.patches.detect`:

* ``deepstack_padded_read``: a read or clear of more rows than were written raises ``ValueError``
  (vLLM 0.20.0). Upstream fix: vllm PR 40932 (in 0.20.2).
* ``deepstack_empty_buffer``: a read of an empty buffer returns ``None``, so the compiled decoder is
  traced without the deepstack additions (vLLM 0.20.0 - 0.22.x). Upstream fix: vllm PR 43617 (0.23.0);
  the device/dtype follow-up is vllm PR 44384.

The replacement methods implement, without copying upstream code:

* a read of N rows never fails: the written rows, then zeros; the buffer grows when N exceeds its
  capacity (never inside a step that could be a captured CUDA graph: capacity starts at
  ``max_num_batched_tokens``, above every capture size);
* a read always returns tensors (zeros when nothing was written), so the compiled graph keeps the adds;
* the buffer lives on the model's device and dtype even when the first step is text-only;
* every write and clear is in place (``copy_``/``zero_``): a captured graph's input addresses stay valid;
* after a clear no stale rows remain, whatever the scheduled and padded counts were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from server.vllm_hooks import models

logger = logging.getLogger("vllm.vlguard.patches")  # runs inside vLLM processes: use its handler

PADDED_READ = "deepstack_padded_read"
EMPTY_BUFFER = "deepstack_empty_buffer"

#: Method names a deepstack model class has, and which patch replaces which of them.
GET, SET, CLEAR = "_get_deepstack_input_embeds", "_set_deepstack_input_embeds", "_clear_deepstack_input_embeds"
METHODS_BY_PATCH = {PADDED_READ: (GET, SET, CLEAR), EMPTY_BUFFER: (GET,)}


class _Recorder:
    """Per-step deepstack instrumentation (worker process). Plain ints only: no host syncs."""

    def __init__(self) -> None:
        from server.metrics import definitions as m

        self._capacity = m.DEEPSTACK_CAPACITY
        self._written = m.DEEPSTACK_WRITTEN
        self._occupancy = m.DEEPSTACK_OCCUPANCY
        self._padded_reads = m.DEEPSTACK_PADDED_READS
        self._padding = m.DEEPSTACK_PADDING
        self._last_capacity = -1

    def read(self, written: int, requested: int, capacity: int) -> None:
        if capacity != self._last_capacity:
            self._capacity.set(capacity)
            self._last_capacity = capacity
        if written == 0:  # a step without image tokens: nothing to record
            return
        self._written.observe(written)
        self._occupancy.observe(written / capacity)
        if requested > written:
            self._padded_reads.inc()
            self._padding.inc(requested - written)


_recorder: _Recorder | None = None


def _record(written: int, requested: int, capacity: int) -> None:
    global _recorder
    try:
        if _recorder is None:
            _recorder = _Recorder()
        _recorder.read(written, requested, capacity)
    except Exception:  # metrics must never take the engine down
        logger.debug("deepstack metrics unavailable", exc_info=True)


def _reference(model: Any, fallback: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    """The device and dtype the decoder runs in (its input embedding), or the buffer's own."""
    try:
        weight = model.language_model.model.embed_tokens.weight
        return weight.device, weight.dtype
    except AttributeError:
        return fallback.device, fallback.dtype


def _ensure_buffer(model: Any, rows: int) -> list[torch.Tensor]:
    """Make the buffer hold at least ``rows`` rows on the model's device/dtype; keep the written rows.

    Reallocates only when the rows do not fit or the device/dtype is wrong (first use); otherwise the
    same tensors (same storage) are returned.
    """
    buffers: list[torch.Tensor] = model.deepstack_input_embeds
    first = buffers[0]
    device, dtype = _reference(model, first)
    if first.size(0) >= rows and first.device == device and first.dtype == dtype:
        return buffers
    capacity = max(rows, first.size(0))
    if first.size(0) < rows:
        logger.warning("deepstack buffer grows from %d to %d rows", first.size(0), rows)
    written = int(getattr(model, "deepstack_input_embeds_num_tokens", 0))
    grown = []
    for old in buffers:
        new = torch.zeros(capacity, old.size(1), device=device, dtype=dtype)
        if written:
            new[:written].copy_(old[:written])
        grown.append(new)
    model.deepstack_input_embeds = grown
    return grown


def get_deepstack_input_embeds(self: Any, num_tokens: int) -> Any:
    """Read ``num_tokens`` rows per deepstack level (the padded step size).

    Arguments:
        num_tokens: rows to return (the step's padded token count).

    Returns:
        ``IntermediateTensors`` with ``deepstack_input_embeds_{level}`` of shape ``[num_tokens, hidden]``:
        the written rows followed by zeros. ``None`` only when the model has no deepstack buffer at
        all (vision tower skipped), as upstream. Never raises for ``num_tokens`` past the written rows.
    """
    from vllm.sequence import IntermediateTensors

    if not getattr(self, "deepstack_input_embeds", None):
        return None
    buffers = _ensure_buffer(self, num_tokens)
    _record(int(getattr(self, "deepstack_input_embeds_num_tokens", 0)), num_tokens, buffers[0].size(0))
    return IntermediateTensors(
        {f"deepstack_input_embeds_{level}": buf[:num_tokens] for level, buf in enumerate(buffers)}
    )


def set_deepstack_input_embeds(self: Any, deepstack_input_embeds: torch.Tensor) -> None:
    """Write one step's deepstack rows, shape ``[levels, num_tokens, hidden]``, in place.

    Rows left over from a longer earlier write (no clear in between) are zeroed, so a later padded
    read never sees them.
    """
    if not getattr(self, "deepstack_input_embeds", None):
        return
    num_tokens = int(deepstack_input_embeds.size(1))
    buffers = _ensure_buffer(self, num_tokens)
    previous = int(getattr(self, "deepstack_input_embeds_num_tokens", 0))
    for level, buf in enumerate(buffers):
        buf[:num_tokens].copy_(deepstack_input_embeds[level])
        if previous > num_tokens:
            buf[num_tokens:previous].zero_()
    self.deepstack_input_embeds_num_tokens = num_tokens


def clear_deepstack_input_embeds(self: Any, num_tokens: int) -> None:
    """Zero the rows written this step, in place, whatever ``num_tokens`` (padded or not) says."""
    if not getattr(self, "deepstack_input_embeds", None):
        return
    written = int(getattr(self, "deepstack_input_embeds_num_tokens", 0))
    if written:
        for buf in self.deepstack_input_embeds:
            buf[:written].zero_()
    self.deepstack_input_embeds_num_tokens = 0


REPLACEMENTS: dict[str, Callable[..., Any]] = {
    GET: get_deepstack_input_embeds,
    SET: set_deepstack_input_embeds,
    CLEAR: clear_deepstack_input_embeds,
}


def is_patched(cls: type, method: str) -> bool:
    """True when ``cls`` already uses vlguard's replacement for ``method``."""
    return getattr(cls, method, None) is REPLACEMENTS[method]


def apply(cls: type, patches: list[str]) -> list[str]:
    """Replace the deepstack methods of ``cls`` that ``patches`` cover (idempotent); the class's own are
    kept for :func:`restore` (:func:`server.vllm_hooks.models.replace_methods`).

    Returns:
        The names of the methods replaced (sorted).
    """
    methods = sorted({name for patch in patches for name in METHODS_BY_PATCH[patch]})
    models.replace_methods(cls, {name: REPLACEMENTS[name] for name in methods})
    return methods


def restore(cls: type) -> list[str]:
    """Put back the methods :func:`apply` replaced on ``cls`` (A/B runs and tests in one process).

    Returns:
        The names of the methods restored (sorted; empty when ``cls`` was not patched).
    """
    return models.restore_methods(cls)
