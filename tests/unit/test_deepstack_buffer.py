"""Semantics of the patched deepstack buffer on the real ``Qwen3VLForConditionalGeneration`` class.

The model is not loaded: an instance is made without ``__init__`` and given the buffer state that
``__init__`` would create, so these tests exercise the class's (patched) methods directly. Both
backports are applied whatever the lane needs (production applies only what :mod:`server.patches.detect`
finds): these tests pin the backports' own behaviour on each lane's class.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from server.patches import deepstack, detect
from tests.lanes import expected_patches

LEVELS, CAPACITY, HIDDEN = 2, 64, 8


@pytest.fixture(scope="module")
def model_cls() -> Iterator[type]:
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as cls

    # vLLM may already have loaded vlguard's plugin in this test process (an earlier test built a vLLM
    # config), which patches the class when the model registry loads it: start from the stock methods.
    was_patched = deepstack.restore(cls)
    assert sorted(detect.defects(cls)) == expected_patches()  # the lane's stock defects, no more, no less
    deepstack.apply(cls, [deepstack.PADDED_READ, deepstack.EMPTY_BUFFER])
    yield cls
    deepstack.restore(cls)
    if was_patched:
        deepstack.apply(cls, detect.defects(cls))


def make(cls: type, dtype: torch.dtype = torch.float32, buffer_dtype: torch.dtype = torch.float32) -> Any:
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.deepstack_num_level = LEVELS
    model.deepstack_input_embeds = [torch.zeros(CAPACITY, HIDDEN, dtype=buffer_dtype) for _ in range(LEVELS)]
    model.deepstack_input_embeds_num_tokens = 0
    embed = SimpleNamespace(weight=torch.zeros(1, HIDDEN, dtype=dtype))
    object.__setattr__(model, "language_model", SimpleNamespace(model=SimpleNamespace(embed_tokens=embed)))
    return model


def rows(n: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((LEVELS, n, HIDDEN), value)


def test_patched_class_reports_no_defects(model_cls: type) -> None:
    assert detect.defects(model_cls) == []


def test_read_past_written_returns_written_then_zeros(model_cls: type) -> None:
    m = make(model_cls)
    m._set_deepstack_input_embeds(rows(5, 3.0))
    out = m._get_deepstack_input_embeds(8)  # padded step: 8 > 5 written
    for level in range(LEVELS):
        t = out[f"deepstack_input_embeds_{level}"]
        assert t.shape == (8, HIDDEN)
        assert torch.equal(t[:5], torch.full((5, HIDDEN), 3.0))
        assert torch.equal(t[5:], torch.zeros(3, HIDDEN))


def test_empty_buffer_returns_zero_tensors(model_cls: type) -> None:
    out = make(model_cls)._get_deepstack_input_embeds(4)
    assert out is not None
    assert all(torch.equal(out[f"deepstack_input_embeds_{i}"], torch.zeros(4, HIDDEN)) for i in range(LEVELS))


def test_read_past_capacity_grows_and_keeps_written_rows(model_cls: type) -> None:
    m = make(model_cls)
    m._set_deepstack_input_embeds(rows(3, 2.0))
    out = m._get_deepstack_input_embeds(CAPACITY + 10)
    t = out["deepstack_input_embeds_0"]
    assert t.shape == (CAPACITY + 10, HIDDEN)
    assert torch.equal(t[:3], torch.full((3, HIDDEN), 2.0)) and not t[3:].any()


def test_clear_after_padded_step_leaves_no_stale_rows(model_cls: type) -> None:
    m = make(model_cls)
    m._set_deepstack_input_embeds(rows(7, 5.0))
    m._get_deepstack_input_embeds(8)
    m._clear_deepstack_input_embeds(8)  # padded count: stock 0.20.0 raises here
    assert m.deepstack_input_embeds_num_tokens == 0
    assert not any(buf.any() for buf in m.deepstack_input_embeds)
    m._set_deepstack_input_embeds(rows(2, 1.0))
    assert not m._get_deepstack_input_embeds(8)["deepstack_input_embeds_1"][2:].any()


def test_shorter_write_without_clear_zeroes_old_rows(model_cls: type) -> None:
    m = make(model_cls)
    m._set_deepstack_input_embeds(rows(6, 4.0))
    m._set_deepstack_input_embeds(rows(2, 1.0))
    assert not m._get_deepstack_input_embeds(6)["deepstack_input_embeds_0"][2:].any()


def test_buffer_moves_to_model_dtype_on_first_text_only_read(model_cls: type) -> None:
    m = make(model_cls, dtype=torch.bfloat16, buffer_dtype=torch.float32)
    out = m._get_deepstack_input_embeds(4)
    assert out["deepstack_input_embeds_0"].dtype == torch.bfloat16
    assert all(buf.dtype == torch.bfloat16 for buf in m.deepstack_input_embeds)


def test_storage_never_moves_for_steps_within_capacity(model_cls: type) -> None:
    # A captured CUDA graph reads from the addresses it saw at capture: steps of every size up to the
    # capacity must read and write the same storage.
    m = make(model_cls)
    m._get_deepstack_input_embeds(1)  # first use settles device and dtype
    ptrs = [buf.data_ptr() for buf in m.deepstack_input_embeds]
    for n in range(1, CAPACITY + 1):
        m._set_deepstack_input_embeds(rows(max(1, n // 2)))
        out = m._get_deepstack_input_embeds(n)
        m._clear_deepstack_input_embeds(n)
        assert [buf.data_ptr() for buf in m.deepstack_input_embeds] == ptrs
        assert out["deepstack_input_embeds_0"].data_ptr() == ptrs[0]


def test_no_buffer_means_no_deepstack(model_cls: type) -> None:
    m = make(model_cls)
    m.deepstack_input_embeds = []  # vision tower skipped
    assert m._get_deepstack_input_embeds(4) is None
