"""Emulate CUDA-graph padding on CPU (``VLGUARD_TEST_EMULATE_PADDING=1``).

CPU runs have no capture sizes, so vLLM never pads a step. On GPU every step is rounded up to the next
CUDA-graph capture size, ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)``. This plugin wraps
``GPUModelRunner._determine_batch_execution_and_padding`` (which the CPU runner inherits) so that the
returned ``BatchDescriptor.num_tokens`` is rounded up the same way, in every vLLM process that loads
plugins (the worker is a separate spawned process, hence a plugin). Steps above the largest size stay
unpadded, as on GPU.

On GPU the KV-cache write kernels write one row per slot-mapping entry and skip ``-1`` slots, so padded
rows never reach the KV cache: the slot mapping is the unpadded length (piecewise graphs) or padded with
``-1`` (full graphs). vLLM's CPU ``cpu_attn_reshape_and_cache`` was never meant to see padding: it writes
one row per *key* row, reading slot-mapping entries past the view's end (stale slots of earlier steps),
so padded rows would overwrite cached KV of other tokens and outputs would change from run to run. The
emulation therefore gives that call the GPU semantics: keys cut to the slot mapping's length, ``-1``
slots dropped. With it, padded runs match unpadded runs exactly (token ids and logprobs, compiled and
eager; ``tests/integration/test_deepstack.py``).

``VLGUARD_TEST_STEP_LOG=<path>`` also appends one JSON line per executed step to ``<path>``:
``{"tokens": scheduled, "padded": run size, "mm": carries image/video placeholder tokens}``, computed
from the scheduler output the worker receives (independent of vlguard's scheduler): the test-side
recorder of the alignment invariant.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import os
from typing import Any

ENV = "VLGUARD_TEST_EMULATE_PADDING"
MAX_ENV = "VLGUARD_TEST_MAX_CAPTURE_SIZE"
STEP_LOG_ENV = "VLGUARD_TEST_STEP_LOG"
logger = logging.getLogger("vllm.vlguard.test_padding")


def capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default CUDA-graph capture sizes up to ``max_size``."""
    return [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]


def padded(num_tokens: int, sizes: list[int]) -> int:
    """The smallest capture size >= ``num_tokens``, or ``num_tokens`` itself above the largest."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else num_tokens


def _skip_padded_kv_slots() -> None:
    from vllm import _custom_ops as ops

    original = getattr(ops, "cpu_attn_reshape_and_cache", None)
    if original is None or getattr(original, "__vlguard_test_padding__", False):
        return

    def cpu_attn_reshape_and_cache(key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any,
                                   *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        rows = slot_mapping.size(0)  # as the CUDA kernels: one KV write per slot-mapping entry
        key, value = key[:rows], value[:rows]
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        # vLLM >= 0.22 passes the scales and the cache dtype as keywords.
        return original(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs)

    cpu_attn_reshape_and_cache.__vlguard_test_padding__ = True  # type: ignore[attr-defined]
    ops.cpu_attn_reshape_and_cache = cpu_attn_reshape_and_cache


def _carries_mm(runner: Any, scheduler_output: Any) -> bool:
    """Whether any request's scheduled range overlaps one of its multimodal placeholders."""
    ranges = {r.req_id: (r.num_computed_tokens, r.mm_features) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        ranges[req_id] = (computed, runner.requests[req_id].mm_features)
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        computed, features = ranges[req_id]
        for feature in features or ():
            pos = feature.mm_position
            if pos.offset < computed + n and pos.offset + pos.length > computed:
                return True
    return False


def _record_steps(path: str, sizes: list[int]) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        total = scheduler_output.total_num_scheduled_tokens
        if total:
            line = {"tokens": total, "padded": padded(total, sizes), "mm": _carries_mm(self, scheduler_output)}
            with open(path, "a") as log:
                log.write(json.dumps(line) + "\n")
        return original(self, scheduler_output, *args, **kwargs)

    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._determine_batch_execution_and_padding
    if getattr(original, "__vlguard_test_padding__", False):
        return
    sizes = capture_sizes(int(os.environ.get(MAX_ENV, "512")))

    def _determine_batch_execution_and_padding(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        mode, desc, *rest = result
        target = padded(desc.num_tokens, sizes)
        if target != desc.num_tokens:
            desc = dataclasses.replace(desc, num_tokens=target)
        return (mode, desc, *rest)

    _determine_batch_execution_and_padding.__vlguard_test_padding__ = True  # type: ignore[attr-defined]
    GPUModelRunner._determine_batch_execution_and_padding = _determine_batch_execution_and_padding  # type: ignore[method-assign]
    _skip_padded_kv_slots()
    if os.environ.get(STEP_LOG_ENV):
        _record_steps(os.environ[STEP_LOG_ENV], sizes)
    logger.warning("vlguard test plugin: emulating CUDA-graph padding to capture sizes up to %d", sizes[-1])
