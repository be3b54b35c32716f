"""The compile-cache load backport (:mod:`server.patches.aot_cache`): a stored inductor artifact gets the
``finalize_loading`` vLLM calls on it, vLLM's own artifacts are left alone, and the wrapper is installed
once. The last test compiles, stores and loads a real inductor artifact with torch (the premise: it
lacks the method), on the default lane only (~15 s)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from server.patches import aot_cache


def _loaded(compiled_fn: Any) -> SimpleNamespace:
    return SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled_fn))


def test_an_inductor_function_gets_a_no_op_finalize_loading() -> None:
    def compiled(*args: Any) -> Any:
        return args

    loaded = _loaded(compiled)
    assert aot_cache.add_finalize_loading(loaded)
    assert loaded._artifacts.compiled_fn.finalize_loading(object()) is None  # what vLLM calls: no error


def test_vllm_own_artifact_and_other_shapes_are_left_alone() -> None:
    own = SimpleNamespace(finalize_loading=lambda cfg: "vllm's")
    assert not aot_cache.add_finalize_loading(_loaded(own))
    assert own.finalize_loading(None) == "vllm's"
    assert not aot_cache.add_finalize_loading(SimpleNamespace())  # no _artifacts
    assert not aot_cache.add_finalize_loading(_loaded(len))  # a builtin takes no attribute: vLLM's behaviour


def test_the_wrapper_adds_it_only_with_patches_on_and_installs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.compiler

    monkeypatch.delenv("VLGUARD_PATCHES", raising=False)

    def load(*args: Any, **kwargs: Any) -> SimpleNamespace:
        return _loaded(lambda: None)  # a new artifact at every load, as torch's loader returns

    monkeypatch.setattr(torch.compiler, "load_compiled_function", load)
    assert aot_cache.install() and aot_cache.install()
    wrapped = torch.compiler.load_compiled_function
    assert getattr(wrapped, "__wrapped__", None) is load  # wrapped once, not twice
    assert hasattr(wrapped()._artifacts.compiled_fn, "finalize_loading")
    monkeypatch.setenv("VLGUARD_PATCHES", "off")
    assert not hasattr(wrapped()._artifacts.compiled_fn, "finalize_loading")


@pytest.mark.full_only
def test_a_real_stored_inductor_artifact_lacks_the_method_and_loads_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    import torch.compiler

    monkeypatch.setattr(torch._dynamo.config, "enable_aot_compile", True)
    x = torch.linspace(-1, 1, 8)
    compiled = torch.compile(_model, fullgraph=True, dynamic=False, backend="inductor").aot_compile(((x,), {}))
    path = tmp_path / "artifact.bin"
    compiled.save_compiled_function(str(path))
    loader = torch.compiler.load_compiled_function  # wrapped already if a test before built vLLM's config
    original = getattr(loader, "__wrapped__", loader)
    with path.open("rb") as f:
        plain = original(f)
    assert not hasattr(plain._artifacts.compiled_fn, "finalize_loading")  # vLLM's load fails on this

    monkeypatch.setattr(torch.compiler, "load_compiled_function", original)
    monkeypatch.delenv("VLGUARD_PATCHES", raising=False)
    aot_cache.install()
    with path.open("rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    loaded._artifacts.compiled_fn.finalize_loading(None)
    assert torch.allclose(loaded(x), _model(x))


def _model(x: Any) -> Any:
    import torch

    return torch.sin(x) * 2 + 1
