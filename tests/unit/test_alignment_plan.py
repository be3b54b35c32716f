"""The alignment decision on hand-built steps (pure logic)."""

from __future__ import annotations

from server.alignment.capture import CaptureSizes, default_capture_sizes
from server.alignment.plan import Chunk, Outcome, decide

SIZES = CaptureSizes(default_capture_sizes(512))
IMAGE = ((20, 256),)  # placeholder tokens 20..275


def _decide(*chunks: Chunk, chunked_mm: bool = True, budget: int = 1024):  # type: ignore[no-untyped-def]
    return decide(chunks, SIZES, budget=budget, chunked_mm=chunked_mm)


def _total_after(decision, *chunks: Chunk) -> int:  # type: ignore[no-untyped-def]
    return sum(c.scheduled for c in chunks) + sum(decision.recompute.values()) - sum(decision.defer.values())


def test_default_capture_sizes_match_vllm() -> None:
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and 248 in sizes and 256 in sizes and 264 not in sizes
    assert sizes[-3:] == [480, 496, 512]
    assert SIZES.needs_padding(289) and SIZES.padded(289) == 304 and SIZES.below(289) == 288
    assert not SIZES.needs_padding(288) and not SIZES.needs_padding(513) and not SIZES.needs_padding(1024)


def test_steps_without_images_are_left_alone() -> None:
    before_image = Chunk("a", computed=0, scheduled=19, mm_spans=IMAGE)  # positions 0..18, image from 20
    assert _decide(before_image).outcome is None
    assert _decide(Chunk("a", computed=0, scheduled=21, mm_spans=IMAGE)).outcome is not None


def test_a_capture_size_step_is_aligned_as_scheduled() -> None:
    decision = _decide(Chunk("a", 0, 288, IMAGE))
    assert decision.outcome is Outcome.ALIGNED and not decision.recompute and not decision.defer


def test_a_cache_hit_residual_is_filled_from_the_hit() -> None:
    """The rescue pass: 256 tokens hit the cache (inside the image), 33 remain; 33 -> 40 by recomputing 7."""
    rescue = Chunk("r", computed=256, scheduled=33, mm_spans=IMAGE, new=True)
    decision = _decide(rescue)
    assert decision.outcome is Outcome.FILLED and decision.recompute == {"r": 7}
    assert _total_after(decision, rescue) == 40


def test_recomputing_into_a_fully_cached_image_is_refused() -> None:
    """The hit (277) is past the image (20..275): its encoder output is not scheduled this step, so the
    step is not filled by recomputing into it (that needs 14 tokens, back to 263); it is trimmed instead."""
    rescue = Chunk("r", computed=277, scheduled=1, mm_spans=IMAGE, new=True)
    other = Chunk("b", computed=0, scheduled=305, mm_spans=((10, 100),))
    decision = _decide(rescue, other)
    assert decision.outcome is Outcome.TRIMMED and decision.defer == {"b": 2}
    assert _total_after(decision, rescue, other) == 304


def test_a_first_pass_is_trimmed() -> None:
    """Primary pass, no hit: 300 tokens -> 288, 12 deferred."""
    primary = Chunk("p", computed=0, scheduled=300, mm_spans=IMAGE, new=True)
    decision = _decide(primary)
    assert decision.outcome is Outcome.TRIMMED and decision.defer == {"p": 12}


def test_decodes_sharing_the_step_are_never_cut() -> None:
    """3 decodes + a 290-token first pass = 293 -> 288: the 5 come off the prefill, not the decodes."""
    decodes = [Chunk(f"d{i}", computed=50, scheduled=1, prefill=False) for i in range(3)]
    primary = Chunk("p", computed=0, scheduled=290, mm_spans=IMAGE, new=True)
    decision = _decide(*decodes, primary)
    assert decision.outcome is Outcome.TRIMMED and decision.defer == {"p": 5}


def test_a_continuing_prefill_is_filled_from_its_own_previous_chunk() -> None:
    """A running request's second chunk (computed 512, 33 scheduled, image inside) -> 40, from 505."""
    chunk = Chunk("p", computed=512, scheduled=33, mm_spans=((500, 40),), new=False)
    decision = _decide(chunk)
    assert decision.outcome is Outcome.FILLED and decision.recompute == {"p": 7}


def test_decodes_are_never_moved_back() -> None:
    """2 decodes + a 1-token image chunk = 3 -> 4: the one recomputed token comes from the image chunk."""
    decodes = [Chunk(f"d{i}", computed=50, scheduled=1, prefill=False) for i in range(2)]
    last = Chunk("p", computed=275, scheduled=1, mm_spans=IMAGE, new=False)
    decision = _decide(*decodes, last)
    assert decision.outcome is Outcome.FILLED and decision.recompute == {"p": 1}


def test_the_cut_is_spread_over_chunks_when_one_cannot_take_it() -> None:
    """11 tokens -> 8: 3 to cut, each 3-token chunk keeps one (gives 2); decodes give none."""
    a = Chunk("a", computed=0, scheduled=3, mm_spans=((0, 30),))
    b = Chunk("b", computed=0, scheduled=3)
    decodes = [Chunk(f"d{i}", computed=40, scheduled=1, prefill=False) for i in range(5)]
    decision = _decide(a, b, *decodes)
    assert decision.outcome is Outcome.TRIMMED and decision.defer == {"a": 2, "b": 1}
    assert _total_after(decision, a, b, *decodes) == 8
    # 15 -> 8 needs 7 and only 4 can go: runs padded.
    more = [Chunk(f"e{i}", computed=40, scheduled=1, prefill=False) for i in range(4)]
    assert _decide(a, b, *decodes, *more).outcome is Outcome.UNALIGNED


def test_disable_chunked_mm_input_never_cuts_inside_an_image() -> None:
    # The chunk ends 4 tokens after the image; trimming 12 would cut inside it.
    chunk = Chunk("p", computed=0, scheduled=300, mm_spans=((0, 296),))
    assert _decide(chunk, chunked_mm=True).outcome is Outcome.TRIMMED
    assert _decide(chunk, chunked_mm=False).outcome is Outcome.UNALIGNED


def test_fill_respects_the_budget() -> None:
    rescue = Chunk("r", computed=256, scheduled=33, mm_spans=IMAGE, new=True)
    assert _decide(rescue, budget=36).outcome is not Outcome.FILLED


def test_speculative_chunks_are_not_trimmed() -> None:
    chunk = Chunk("p", computed=0, scheduled=300, mm_spans=IMAGE, trimmable=False)
    assert _decide(chunk).outcome is Outcome.UNALIGNED
