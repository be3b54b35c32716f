"""The backport of transformers PR #45807 (:mod:`server.vllm_hooks.hf_processor`): the tiny Qwen3-VL's real
Hugging Face processor, called as vLLM's renderer calls it for an image request. Every lane runs it: the
transformers of 0.20.0 and 0.22.1 (5.6.2) lack the fix, that of 0.32.0 on (5.19.0) has it."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, TypedDict

import pytest
from PIL import Image

from server.vllm_hooks import hf_processor


def _merged(name: str = "merged_typed_dict", **fields: Any) -> Any:
    return TypedDict(name, fields or {"do_resize": bool, "size": dict}, total=False)  # type: ignore[operator]


def test_equal_schemas_become_one_object_and_others_stay_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_processor, "_schemas", {})
    first, second = _merged(), _merged()
    assert first is not second
    assert hf_processor.canonical(first) is first and hf_processor.canonical(second) is first
    other = _merged(do_resize=bool)
    assert hf_processor.canonical(other) is other  # other fields
    assert hf_processor.canonical(_merged("other_name")) is not first  # another name
    unhashable = _merged()
    unhashable.__annotations__["size"] = [int]  # a list cannot be hashed: passed on as it came
    assert hf_processor.canonical(unhashable) is unhashable


def test_at_most_max_schemas_contents_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_processor, "_schemas", {})
    monkeypatch.setattr(hf_processor, "MAX_SCHEMAS", 2)
    kept = [hf_processor.canonical(_merged(**{f"f{i}": int})) for i in range(2)]
    late = _merged(f9=int)
    assert hf_processor.canonical(late) is late and hf_processor.canonical(_merged(f9=int)) is not late
    assert [hf_processor.canonical(_merged(**{f"f{i}": int})) for i in range(2)] == kept


def _processor(tiny_model: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_model))


def _call(processor: Any, **kwargs: Any) -> Any:
    """One image request's processor call, as vLLM's renderer makes it (text with the image's placeholder)."""
    text = "<|vision_start|><|image_pad|><|vision_end|>Is the loading bay clear?"
    return processor(text=[text], images=[Image.new("RGB", (64, 48), "gray")], return_tensors="pt", **kwargs)


def _strict_classes_built(processor: Any, calls: int, **kwargs: Any) -> int:
    from huggingface_hub import dataclasses as hub

    _call(processor, **kwargs)  # warm: every schema seen once
    before = hub._build_strict_cls_from_typed_dict.cache_info().misses
    for _ in range(calls):
        _call(processor, **kwargs)
    return int(hub._build_strict_cls_from_typed_dict.cache_info().misses - before)


def test_stock_builds_a_strict_dataclass_at_every_image_call_and_the_backport_none(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    processing = importlib.import_module(hf_processor.MODULE)
    processor = _processor(tiny_model)
    if hf_processor.upstream_fixed():
        assert "not needed" in hf_processor.install()
        assert _strict_classes_built(processor, 5) == 0  # transformers keeps them itself
        return
    hf_processor.install()
    backported = processing.validate_typed_dict
    with monkeypatch.context() as stock:
        stock.setattr(processing, "validate_typed_dict", backported.__wrapped__)
        # the upstream defect: two a call (Qwen3-VL's image and video kwargs), for an image-only call too
        assert _strict_classes_built(processor, 5) == 10
    assert processing.validate_typed_dict is backported
    assert _strict_classes_built(processor, 5) == 0
    assert hf_processor.install().startswith("transformers' processor schemas kept")  # idempotent
    assert processing.validate_typed_dict is backported


def test_the_check_refuses_what_it_refused_and_the_output_is_the_same(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    processing = importlib.import_module(hf_processor.MODULE)
    processor = _processor(tiny_model)
    hf_processor.install()
    outcomes = []
    for check in ("as installed", "stock"):
        with monkeypatch.context() as m:
            if check == "stock":
                m.setattr(processing, "validate_typed_dict", getattr(processing.validate_typed_dict, "__wrapped__",
                                                                     processing.validate_typed_dict))  # fmt: skip
            out = _call(processor)
            with pytest.raises(Exception) as refused:
                _call(processor, do_resize="yes")  # a bool field given a string
            outcomes.append((sorted(out.keys()), out["pixel_values"].shape, type(refused.value), str(refused.value)))
    assert outcomes[0] == outcomes[1]
    assert "do_resize" in outcomes[0][3]
