"""Hooks on vLLM's engine core and its scheduler (engine-core process).

The fatal recorder (:mod:`server.engine.fatal`) and soft recovery (:mod:`server.engine.soft`) decide;
the functions here are what they do to vLLM: wrap the busy loop, a step and admission, watch the
scheduler's steps, and, after a fault, drain, check the device, finish every request, reset the caches
and send the finishes. Targets (``vllm.v1.engine.core``, ``vllm.v1.core.sched.scheduler``) are listed in
:data:`server.vllm_hooks.TARGETS`; checked on vLLM 0.20.0, 0.22.1, 0.32.0 and 0.34.0.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from server.vllm_hooks import HookTargetMissing, wrap
from server.vllm_hooks.locations import finished_requests


def wrap_busy_loop(make: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> None:
    """Replace ``vllm.v1.engine.core.EngineCoreProc.run_busy_loop(self)`` by ``make(original)``, once per
    process: the engine-core process's loop (admission, steps, output), which vLLM leaves to report the
    engine dead.

    Raises:
        HookTargetMissing: an unsupported vLLM version.
    """
    from vllm.v1.engine.core import EngineCoreProc

    wrap(EngineCoreProc, "run_busy_loop", make, "vllm.v1.engine.core.EngineCoreProc.run_busy_loop")


def delay_block_caching(kv_cache_manager: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``kv_cache_manager.allocate_slots(request, ..., delay_cache_blocks=...)`` on this instance by
    ``make(original)`` (the aligned scheduler registers a step's blocks in the prefix cache after it trimmed
    the step, :mod:`server.alignment.scheduler`).

    Raises:
        HookTargetMissing: an unsupported vLLM version.
    """
    wrap(kv_cache_manager, "allocate_slots", make, "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots",
         once=False)  # fmt: skip


def time_steps(core: Any, make: Callable[[Callable[[], Any]], Callable[[], Any]]) -> None:
    """Replace this engine core's ``step_fn()`` by ``make(original)``: bench only (the engine scenario times
    every step, :mod:`server.workload.engine_step`).

    Raises:
        HookTargetMissing: an unsupported vLLM version.
    """
    wrap(core, "step_fn", make, "vllm.v1.engine.core.EngineCore.step_fn", once=False)


def watch_scheduler_steps(
    scheduler: Any,
    make_schedule: Callable[[Callable[..., Any]], Callable[..., Any]],
    make_update: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Replace ``scheduler.schedule()`` and ``scheduler.update_from_output(scheduler_output, ...)`` on this
    scheduler instance (vLLM's ``Scheduler``, or vlguard's aligned one) by ``make_*(original)``.

    Raises:
        HookTargetMissing: the scheduler lacks either method.
    """
    wrap(scheduler, "schedule", make_schedule, "Scheduler.schedule", once=False)
    wrap(scheduler, "update_from_output", make_update, "Scheduler.update_from_output", once=False)


def step_ids(scheduler_output: Any) -> tuple[list[str], list[str]]:
    """``(every scheduled request id, newly scheduled ids)`` of one ``SchedulerOutput``."""
    scheduled = list(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
    new = [r.req_id for r in getattr(scheduler_output, "scheduled_new_reqs", None) or []]
    return scheduled, new


def steps_in_execution(core: Any) -> int:
    """Steps an engine core executes at once: 1, or its batch queue's size (pipelined scheduling)."""
    return max(1, getattr(core, "batch_queue_size", 1) or 1)


def held_requests(core: Any) -> list[str]:
    """Engine-side ids of every request the engine core's scheduler holds."""
    return list(core.scheduler.requests)


def guard_step_and_admission(
    core: Any,
    make_step: Callable[[Callable[[], Any]], Callable[[], Any]],
    make_add_request: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Replace ``core.step_fn()`` (``EngineCore.step`` or its batch-queue twin, chosen per instance in
    ``__init__``) and ``core.add_request(request, ...)`` on this engine core by ``make_*(original)``.

    Raises:
        HookTargetMissing: the engine core lacks either (then neither is wrapped).
    """
    for name in ("step_fn", "add_request"):
        if getattr(core, name, None) is None:
            raise HookTargetMissing(f"EngineCore.{name} not found: unsupported vLLM version")
    wrap(core, "step_fn", make_step, "EngineCore.step_fn", once=False)
    wrap(core, "add_request", make_add_request, "EngineCore.add_request", once=False)


def is_pooling(core: Any) -> bool:
    """Whether the engine core runs a pooling model (its outputs carry a pooling result, no tokens)."""
    return bool(getattr(core, "is_pooling_model", False))


def wait_for_batches(core: Any) -> None:
    """Let the batches still executing in the worker end (pipelined scheduling: ``core.batch_queue``);
    their results, and their exceptions, are dropped."""
    queue = getattr(core, "batch_queue", None)
    while queue:
        future = queue.pop()[0]
        try:
            future.result()
        except Exception:  # the step that raised first is the one recorded
            continue


def _synchronize_device(worker: Any) -> bool:
    """Run in each worker: wait for the device to finish its work (raises on a poisoned context), and drop
    the model runner's state of a step whose ``execute_model`` ran but whose ``sample_tokens`` never will
    (the step failed around it: vLLM refuses every later ``execute_model`` while it is set; the GPU model
    runner's ``execute_model_state``, :data:`server.vllm_hooks.GPU_MODEL_RUNNERS`)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    runner = getattr(worker, "model_runner", None)
    if getattr(runner, "execute_model_state", None) is not None:
        runner.execute_model_state = None  # type: ignore[union-attr]
    return True


def synchronize_workers(core: Any, timeout_s: float = 30.0) -> None:
    """One synchronising call in every worker (``core.model_executor.collective_rpc``).

    Raises:
        Exception: a worker's device failed it (a poisoned context), or it timed out.
    """
    core.model_executor.collective_rpc(_synchronize_device, timeout=timeout_s)


def finish_every_request(core: Any, status_name: str = "FINISHED_ERROR") -> list[tuple[str, int]]:
    """Finish every request the scheduler holds with ``RequestStatus.<status_name>`` (their KV blocks,
    encoder-cache entries and worker-side state are freed), plus those still queued that it had already
    freed (:func:`_drop_freed_requests`); forget the previous step's scheduled ids.

    Returns:
        ``(request id, client index)`` of each request finished.
    """
    from vllm.v1.request import RequestStatus

    scheduler = core.scheduler
    status = getattr(RequestStatus, status_name)
    cut = finished_requests(scheduler.finish_requests(list(scheduler.requests), status))
    cut += _drop_freed_requests(scheduler)
    if isinstance(prev := getattr(scheduler, "prev_step_scheduled_req_ids", None), set):
        prev.clear()
    return cut


def _drop_freed_requests(scheduler: Any) -> list[tuple[str, int]]:
    """Requests still queued that the scheduler already freed: ``update_from_output`` frees a request that
    stopped and removes it from the running list only after its loop, so an exception later in that loop
    leaves it queued, its final output lost. Removes them from the queues; returns ``(id, client index)``
    for an ``ERROR`` finish (the guard replays them: their answer never left the engine)."""
    stale = [r for r in scheduler.running if r.request_id not in scheduler.requests]
    if stale:
        scheduler.running = [r for r in scheduler.running if r.request_id in scheduler.requests]
    for name in ("waiting", "skipped_waiting"):
        queue = getattr(scheduler, name, None)
        if queue is None:
            continue
        gone = [r for r in queue if r.request_id not in scheduler.requests]
        if gone:
            queue.remove_requests(gone)
            stale += gone
    return [(r.request_id, r.client_index) for r in stale]


def reset_caches(core: Any) -> None:
    """Reset the prefix cache (no block may be in use) and the encoder cache (scheduler and workers).

    Raises:
        RuntimeError: the prefix cache could not be reset (blocks still in use).
    """
    if not core.scheduler.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (blocks still in use)")
    core.reset_encoder_cache()


def send_error_finishes(core: Any, cut: list[tuple[str, int]]) -> None:
    """One ``ERROR`` finish with no tokens per cut request, to the API-side client that sent it (through
    the engine core's ``output_queue``)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    by_client: dict[int, list[str]] = collections.defaultdict(list)
    for rid, client in cut:
        by_client[client].append(rid)
    for client, rids in by_client.items():
        outputs = [EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR) for rid in rids]
        core.output_queue.put_nowait((client, EngineCoreOutputs(outputs=outputs, finished_requests=set(rids))))
