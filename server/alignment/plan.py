"""The alignment decision for one scheduled step (pure logic, no vLLM imports).

Invariant: a step that carries image (or video) placeholder tokens has a total token count that needs
no CUDA-graph padding (a capture size, or above the largest one). vLLM's scheduler is greedy: when a
step is below the largest capture size, every token that could be scheduled already is, so the step can
only reach a capture size by

1. **filling** it up to the next capture size by recomputing the last ``p`` tokens before a prefill
   chunk (its prefix-cache hit, or its own previous chunk): no extra step, ``p`` tokens recomputed; or
2. **trimming** it down to the capture size below: the last ``d`` tokens of one or more prefill chunks
   move to the next step (one more, small step later; ``d`` tokens deferred).

Each choice must keep the engine's bookkeeping true:

* a chunk keeps at least one token, and chunks with speculative tokens are left alone;
* recomputed tokens must not touch an image whose encoder output is not available in this step (only
  images that also overlap the chunk's own range are);
* with ``--disable-chunked-mm-input`` neither choice may move a chunk boundary strictly inside an image.

(The scheduler registers KV blocks in the prefix cache only after alignment, so a trimmed chunk never
leaves a block registered that it has not computed; see :mod:`server.alignment.scheduler`.)

When neither works the step runs as scheduled ("unaligned"); the deepstack backport covers it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.alignment.capture import CaptureSizes


class Outcome(enum.StrEnum):
    """What alignment did to a step that carries multimodal tokens (the metric's ``outcome`` label)."""

    ALIGNED = "aligned"  # needed no padding as scheduled
    FILLED = "filled"  # grown to the next capture size by recomputing cache-hit tokens
    TRIMMED = "trimmed"  # cut to the capture size below by deferring chunk tails
    UNALIGNED = "unaligned"  # no safe choice: runs padded (the deepstack backport covers it)


@dataclass(frozen=True)
class Chunk:
    """One request's part of a step, in token positions of that request.

    Attributes:
        req_id: the request.
        computed: tokens already in the KV cache before this step (cache hit included).
        scheduled: tokens scheduled in this step, positions ``[computed, computed + scheduled)``.
        mm_spans: ``(offset, length)`` of each multimodal placeholder of the request.
        new: first scheduled in this step (else a running request continuing).
        prefill: the chunk lies within the prompt (no generated tokens): its start may move back.
        trimmable: may be cut (False with speculative tokens).
    """

    req_id: str
    computed: int
    scheduled: int
    mm_spans: tuple[tuple[int, int], ...] = ()
    new: bool = False
    prefill: bool = True
    trimmable: bool = True

    @property
    def end(self) -> int:
        return self.computed + self.scheduled

    def carries_mm(self) -> bool:
        return any(off < self.end and off + length > self.computed for off, length in self.mm_spans)

    def inside_mm(self, pos: int) -> tuple[int, int] | None:
        """The span that ``pos`` cuts strictly inside (a boundary there splits that image), if any."""
        return next(((o, n) for o, n in self.mm_spans if o < pos < o + n), None)


@dataclass(frozen=True)
class Decision:
    """What to change: ``recompute[req]`` tokens moved from the cache hit into the step, ``defer[req]``
    tokens cut from the chunk's end. ``outcome`` is None for steps without multimodal tokens."""

    outcome: Outcome | None
    recompute: dict[str, int] = field(default_factory=dict)
    defer: dict[str, int] = field(default_factory=dict)


def _fill_ok(chunk: Chunk, p: int, chunked_mm: bool) -> bool:
    if not chunk.prefill or not chunk.trimmable or chunk.computed < p:
        return False
    start = chunk.computed - p
    for off, length in chunk.mm_spans:
        overlaps_recomputed = off < chunk.computed and off + length > start
        overlaps_step = off < chunk.end and off + length > chunk.computed
        if overlaps_recomputed and not overlaps_step:
            return False  # its encoder output is not available in this step
    if not chunked_mm:
        span = chunk.inside_mm(start)
        if span is not None and span != chunk.inside_mm(chunk.computed):
            return False
    return True


def _trim_room(chunk: Chunk) -> int:
    """Tokens that may be cut from the chunk's end (it keeps one)."""
    return chunk.scheduled - 1 if chunk.trimmable else 0


def _trim_ok(chunk: Chunk, k: int, chunked_mm: bool) -> bool:
    return chunked_mm or chunk.inside_mm(chunk.end - k) is None


def decide(chunks: Sequence[Chunk], sizes: CaptureSizes, *, budget: int, chunked_mm: bool = True) -> Decision:
    """Choose how to align one step.

    Arguments:
        chunks: the step's scheduled chunks, in scheduling order.
        sizes: the capture sizes the engine pads to.
        budget: the step's token budget (``max_num_batched_tokens``).
        chunked_mm: False under ``--disable-chunked-mm-input``.

    Returns:
        The decision; its changes bring the step's total to a size that needs no padding, or are empty.
    """
    if not any(c.carries_mm() for c in chunks):
        return Decision(None)
    total = sum(c.scheduled for c in chunks)
    if not sizes.needs_padding(total):
        return Decision(Outcome.ALIGNED)

    up = sizes.padded(total)
    p = up - total
    if up <= budget:
        for chunk in sorted(chunks, key=lambda c: not c.new):  # a cache hit's tokens first
            if _fill_ok(chunk, p, chunked_mm):
                return Decision(Outcome.FILLED, recompute={chunk.req_id: p})

    d = total - sizes.below(total)
    # One chunk taking the whole cut keeps the extra work to one request; else spread it greedily.
    for chunk in chunks:
        if _trim_room(chunk) >= d and _trim_ok(chunk, d, chunked_mm):
            return Decision(Outcome.TRIMMED, defer={chunk.req_id: d})
    defer: dict[str, int] = {}
    left = d
    for chunk in chunks:
        k = min(left, _trim_room(chunk))
        while k > 0 and not _trim_ok(chunk, k, chunked_mm):
            k -= 1
        if k:
            defer[chunk.req_id] = k
            left -= k
        if not left:
            return Decision(Outcome.TRIMMED, defer=defer)
    return Decision(Outcome.UNALIGNED)
