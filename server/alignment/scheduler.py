"""vLLM's scheduler with per-request chunk alignment (``--scheduler-cls server.alignment.scheduler.AlignedScheduler``).

Runs in the engine-core process. After vLLM's scheduler has built a step, and before it advances the
requests' computed-token counts (``_update_after_schedule``), the step is aligned as
:func:`server.alignment.plan.decide` says: a request's cache hit is shortened (tokens recomputed) or a
chunk's tail is deferred to the next step, so that no step carrying image tokens is CUDA-graph padded
and the deepstack buffer is never read past what was written (the crash of vllm issue 40932 / PR 40932,
"Requested more deepstack tokens than available in buffer").

Also fixes, under ``--disable-chunked-mm-input``, vLLM 0.20's split of an image whose first token is
exactly where the chunk starts while the remaining budget is smaller than the image: the request waits
for a step with room for the whole image instead (when the image fits the full budget at all).

``AlignedScheduler(...)`` returns an instance built on vLLM's ``AsyncScheduler`` or ``Scheduler``,
whichever the engine's ``async_scheduling`` setting asks for (vLLM only picks it itself when no
``--scheduler-cls`` is given).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from server.alignment.capture import CaptureSizes, default_capture_sizes
from server.alignment.plan import Chunk, Decision, decide
from server.engine.protocol import ServeSettings
from server.vllm_hooks import engine_core

logger = logging.getLogger("vllm.vlguard.alignment")  # engine-core process: use vLLM's handler


def engine_capture_sizes(vllm_config: Any) -> CaptureSizes:
    """The capture sizes this engine pads steps to: ``compilation_config.cudagraph_capture_sizes`` when
    CUDA graphs are on, none when they are off (eager), or the default sizes up to
    ``ServeSettings.alignment_max_capture_size`` when that is set."""
    from vllm.config import CUDAGraphMode

    override = ServeSettings.from_environ().alignment_max_capture_size
    if override > 0:
        return CaptureSizes(default_capture_sizes(override))
    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode in (None, CUDAGraphMode.NONE):
        return CaptureSizes([])
    return CaptureSizes(compilation.cudagraph_capture_sizes or [])


def _chunk(request: Request, scheduled: int, new: bool, spec: bool) -> Chunk:
    spans = tuple((f.mm_position.offset, f.mm_position.length) for f in (request.mm_features or ()))
    return Chunk(
        request.request_id,
        request.num_computed_tokens,
        scheduled,
        spans,
        new=new,
        prefill=request.num_computed_tokens + scheduled <= request.num_prompt_tokens,
        trimmable=not spec,
    )


class _Recorder:
    """``vlguard_alignment_*`` metrics; never lets a metrics failure reach the scheduler."""

    def record(self, decision: Decision) -> None:
        if decision.outcome is None:
            return
        try:
            from server.metrics import definitions as m

            m.ALIGNMENT_STEPS.labels(outcome=decision.outcome.value).inc()
            if decision.recompute:
                m.ALIGNMENT_RECOMPUTED.inc(sum(decision.recompute.values()))
            if decision.defer:
                m.ALIGNMENT_DEFERRED.inc(sum(decision.defer.values()))
        except Exception:
            logger.debug("alignment metrics unavailable", exc_info=True)


class _AlignmentMixin:
    """The alignment step, for any subclass of vLLM's ``Scheduler``."""

    requests: dict[str, Request]
    kv_cache_manager: Any
    max_num_scheduled_tokens: int
    scheduler_config: Any

    def _init_alignment(self, vllm_config: Any) -> None:
        self.capture_sizes = engine_capture_sizes(vllm_config)
        self._alignment_recorder = _Recorder()
        self._cache_after_step: dict[str, Request] = {}
        if not self.capture_sizes:
            logger.info("vlguard alignment idle: this engine pads no step (no CUDA graphs)")
            return
        logger.info(
            "vlguard alignment on: %d capture sizes up to %d tokens",
            len(self.capture_sizes.sizes),
            self.capture_sizes.largest,
        )
        self._delay_prefix_caching()

    def _delay_prefix_caching(self) -> None:
        """Register a step's KV blocks in the prefix cache after alignment, not at allocation.

        vLLM caches every block the step's tokens will fill when it allocates them; a chunk trimmed
        afterwards would leave a registered block that is not computed, which another request could hit.
        Cost: a request no longer hits blocks that another request fills in the same step.
        """

        def delayed(allocate: Callable[..., Any]) -> Callable[..., Any]:
            def allocate_slots(request: Request, *args: Any, delay_cache_blocks: bool = False, **kwargs: Any) -> Any:
                blocks = allocate(request, *args, delay_cache_blocks=True, **kwargs)
                if blocks is not None and not delay_cache_blocks:
                    self._cache_after_step[request.request_id] = request
                return blocks

            return allocate_slots

        engine_core.delay_block_caching(self.kv_cache_manager, delayed)

    def align(self, output: SchedulerOutput) -> Decision:
        """Apply :func:`~server.alignment.plan.decide` to ``output`` in place (before computed-token counts
        advance). Returns the decision taken."""
        new_ids = {r.req_id for r in output.scheduled_new_reqs}
        chunks = [
            _chunk(self.requests[rid], n, rid in new_ids, rid in output.scheduled_spec_decode_tokens)
            for rid, n in output.num_scheduled_tokens.items()
        ]
        decision = decide(
            chunks,
            self.capture_sizes,
            budget=self.max_num_scheduled_tokens,
            chunked_mm=not self.scheduler_config.disable_chunked_mm_input,
        )
        new_data = {r.req_id: r for r in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        for rid, p in decision.recompute.items():
            self.requests[rid].num_computed_tokens -= p
            if rid in new_data:
                new_data[rid].num_computed_tokens -= p
            else:
                cached.num_computed_tokens[cached.req_ids.index(rid)] -= p
            output.num_scheduled_tokens[rid] += p
            output.total_num_scheduled_tokens += p
        for rid, d in decision.defer.items():
            output.num_scheduled_tokens[rid] -= d
            output.total_num_scheduled_tokens -= d
        return decision

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        if self.capture_sizes:
            self._alignment_recorder.record(self.align(scheduler_output))
            for rid, request in self._cache_after_step.items():
                scheduled = scheduler_output.num_scheduled_tokens.get(rid)
                if scheduled:  # not preempted later in the step
                    end = min(request.num_computed_tokens + scheduled, request.num_tokens)
                    self.kv_cache_manager.cache_blocks(request, end)
            self._cache_after_step.clear()
        super()._update_after_schedule(scheduler_output)  # type: ignore[misc]

    def _try_schedule_encoder_inputs(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int = 0,
    ) -> tuple[Any, ...]:
        """vLLM's choice, except that under ``--disable-chunked-mm-input`` an image starting exactly at
        the chunk's first token is not split by a short budget: the request waits for the next step.

        "Schedule nothing" is asked of vLLM itself (zero new tokens) rather than built here: the result's
        shape differs between vLLM versions (4 values in 0.20-0.22, 5 in 0.32)."""
        if self.scheduler_config.disable_chunked_mm_input and request.mm_features:
            start = num_computed_tokens + shift_computed_tokens
            for feature in request.mm_features:
                pos = feature.mm_position
                if pos.offset == start and num_new_tokens < pos.length <= self.max_num_scheduled_tokens:
                    num_new_tokens = 0
                    break
        return super()._try_schedule_encoder_inputs(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens, encoder_compute_budget, shift_computed_tokens
        )


class _AlignedSyncScheduler(_AlignmentMixin, Scheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._init_alignment(vllm_config)


class _AlignedAsyncScheduler(_AlignmentMixin, AsyncScheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._init_alignment(vllm_config)


class AlignedScheduler:
    """Factory vLLM calls as its scheduler class; see the module docstring."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Scheduler:  # type: ignore[misc]
        base = _AlignedAsyncScheduler if vllm_config.scheduler_config.async_scheduling else _AlignedSyncScheduler
        return base(vllm_config, *args, **kwargs)
