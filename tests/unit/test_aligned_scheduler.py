"""vlguard's scheduler against vLLM 0.20.0's real ``Scheduler`` on a real engine config (the tiny
model's), stepped without a model: what each step schedules is all that is looked at here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from server.alignment import MAX_CAPTURE_ENV
from server.alignment.scheduler import AlignedScheduler

BLOCK = 32
init_none_hash(sha256)  # once: the root of every block hash (random per call)


def _scheduler(cls: type, tiny_model: Path, *, budget: int, chunked_mm: bool = True, threshold: int = 0) -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), max_model_len=4096),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=8,
            max_model_len=4096,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            disable_chunked_mm_input=not chunked_mm,
            long_prefill_token_threshold=threshold,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
    )
    config.cache_config.num_gpu_blocks = 512
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=512, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return cls(  # type: ignore[no-any-return]
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def _request(req_id: str, tokens: list[int], images: list[tuple[int, int, str]]) -> Request:
    """A request whose ``images`` are ``(offset, length, content hash)`` placeholder spans."""
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=h, mm_position=PlaceholderRange(o, n))
        for o, n, h in images
    ]
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=4),
        None,
        mm_features=features or None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _steps(scheduler: Scheduler, limit: int = 12) -> Iterator[SchedulerOutput]:
    for _ in range(limit):
        out = scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            return
        yield out


def _ranges(out: SchedulerOutput, req_id: str, computed_before: dict[str, int]) -> tuple[int, int] | None:
    n = out.num_scheduled_tokens.get(req_id)
    if n is None:
        return None
    start = computed_before[req_id]
    return start, start + n


def _image_splits(cls: type, tiny_model: Path) -> list[tuple[int, int]]:
    """Chunks of ``b`` that cut its image (placeholders 100..299) when ``a``'s chunk, scheduled first,
    leaves less budget than the image and ``b``'s previous chunk ended exactly at the image."""
    scheduler = _scheduler(cls, tiny_model, budget=400, chunked_mm=False, threshold=300)
    scheduler.add_request(_request("a", [7] * 900, []))
    scheduler.add_request(_request("b", [5] * 100 + [9] * 200 + [6] * 10, [(100, 200, "img-b")]))
    splits = []
    for out in _steps(scheduler):
        computed = {rid: scheduler.requests[rid].num_computed_tokens - n for rid, n in out.num_scheduled_tokens.items()}
        span = _ranges(out, "b", computed)
        if span and span[0] < 300 and span[1] > 100 and not (span[0] <= 100 and span[1] >= 300):
            splits.append(span)
    return splits


def test_stock_scheduler_splits_an_image_that_starts_a_chunk(tiny_model: Path) -> None:
    """The control: vLLM up to 0.32.0 with --disable-chunked-mm-input still cuts the image at 100..200;
    0.34.0 fixed it upstream (tests/lanes.py)."""
    from tests.lanes import SPLITS_IMAGE_AT_CHUNK_START, VLLM_VERSION

    expected = [(100, 200), (200, 300)] if SPLITS_IMAGE_AT_CHUNK_START[VLLM_VERSION] else []
    assert _image_splits(Scheduler, tiny_model) == expected


def test_aligned_scheduler_keeps_that_image_whole(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MAX_CAPTURE_ENV, raising=False)  # the boundary fix does not depend on capture sizes
    assert _image_splits(AlignedScheduler, tiny_model) == []


def test_rescue_residual_is_filled_from_the_cache_hit(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two-pass on one image. The primary (20 text + 256 image + 5 text = 281 tokens) runs as 272 (capture
    sizes go by 16 above 256: 9 deferred) and 16 (the 9, still with image tokens, filled by recomputing 7
    of its own). The rescue (primary + 40 more) hits the 256 cached tokens, leaving 65: filled to 72 by
    recomputing 7 of the hit, inside the image."""
    monkeypatch.setenv(MAX_CAPTURE_ENV, "512")
    scheduler = _scheduler(AlignedScheduler, tiny_model, budget=1024)
    primary = [5] * 20 + [9] * 256 + [6] * 5
    scheduler.add_request(_request("primary", primary, [(20, 256, "img")]))
    totals = [out.total_num_scheduled_tokens for out in _steps(scheduler)]
    assert totals == [272, 16]

    scheduler.add_request(_request("rescue", primary + [8] * 40, [(20, 256, "img")]))
    out = scheduler.schedule()
    new = {r.req_id: r for r in out.scheduled_new_reqs}["rescue"]
    assert new.num_computed_tokens == 256 - 7
    assert out.num_scheduled_tokens["rescue"] == out.total_num_scheduled_tokens == 72
    assert scheduler.requests["rescue"].num_computed_tokens == 321


def test_a_trimmed_chunk_never_leaves_an_uncomputed_block_in_the_prefix_cache(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x (35 text tokens) and p (20 + 256 image + 14 = 290) share a step of 325 tokens: 5 are deferred from
    x, which then stops at 30, inside its first block (0..31). vLLM registers blocks in the prefix cache
    at allocation; if block 0 were registered, x2 (same 35 tokens) would hit tokens 30 and 31 before x
    computed them. vlguard registers after alignment: x2 gets no hit on that block."""
    monkeypatch.setenv(MAX_CAPTURE_ENV, "512")
    scheduler = _scheduler(AlignedScheduler, tiny_model, budget=1024)
    scheduler.add_request(_request("x", [3] * 35, []))
    scheduler.add_request(_request("p", [5] * 20 + [9] * 256 + [6] * 14, [(20, 256, "img")]))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"x": 30, "p": 290} and first.total_num_scheduled_tokens == 320

    scheduler.add_request(_request("x2", [3] * 35, []))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens["x"] == 5
    assert {r.req_id: r.num_computed_tokens for r in second.scheduled_new_reqs} == {"x2": 0}
    # Once x has computed its block it is registered as usual: a later copy hits it.
    scheduler.add_request(_request("x3", [3] * 35, []))
    assert {r.req_id: r.num_computed_tokens for r in scheduler.schedule().scheduled_new_reqs} == {"x3": 32}
