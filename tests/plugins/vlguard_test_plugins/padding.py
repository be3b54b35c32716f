"""Emulate CUDA-graph padding on CPU (``VLGUARD_TEST_EMULATE_PADDING=1``).

CPU runs have no capture sizes, so vLLM never pads a step. On GPU every step is rounded up to the next
CUDA-graph capture size, ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)``. This plugin wraps
``GPUModelRunner._determine_batch_execution_and_padding`` (which the CPU runner inherits) so that the
returned ``BatchDescriptor.num_tokens`` is rounded up the same way, in every vLLM process that loads
plugins (the worker is a separate spawned process, hence a plugin). Steps above the largest size stay
unpadded, as on GPU.

The GPU runner marks the padded rows' KV slots ``-1`` and the CUDA cache kernels skip them; vLLM's CPU
``cpu_attn_reshape_and_cache`` was never meant to see padding and does not. So the emulation also drops
the ``-1`` rows before that call; without it the padded rows overwrite KV-cache memory and outputs
change from run to run.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
from typing import Any

ENV = "VLGUARD_TEST_EMULATE_PADDING"
MAX_ENV = "VLGUARD_TEST_MAX_CAPTURE_SIZE"
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
                                   *args: Any) -> Any:  # fmt: skip
        keep = slot_mapping >= 0
        if bool(keep.all()):
            return original(key, value, key_cache, value_cache, slot_mapping, *args)
        return original(key[keep], value[keep], key_cache, value_cache, slot_mapping[keep], *args)

    cpu_attn_reshape_and_cache.__vlguard_test_padding__ = True  # type: ignore[attr-defined]
    ops.cpu_attn_reshape_and_cache = cpu_attn_reshape_and_cache


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
    logger.warning("vlguard test plugin: emulating CUDA-graph padding to capture sizes up to %d", sizes[-1])
