"""The API process's backport (:mod:`server.vllm_hooks.hf_processor`) as ``vlguard serve`` installs it:
where the installed transformers needs it, and not with ``--guard-patches off``."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from server.vllm_hooks import MARK, hf_processor


async def test_the_app_installs_the_processor_check_backport_unless_patches_are_off(
    make_api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    processing = importlib.import_module(hf_processor.MODULE)
    stock = getattr(processing.validate_typed_dict, "__wrapped__", processing.validate_typed_dict)
    monkeypatch.setattr(processing, "validate_typed_dict", stock)  # as before any app of this process
    await make_api("--guard-patches", "off")
    assert processing.validate_typed_dict is stock
    await make_api()
    assert getattr(processing.validate_typed_dict, MARK, False) is not hf_processor.upstream_fixed()
