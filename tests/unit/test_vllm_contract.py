"""Every vLLM function vlguard wraps or replaces, and every vLLM attribute it reaches into (the contact
layer's lists: :data:`server.vllm_hooks.TARGETS`, :data:`server.vllm_hooks.INSTANCE_ATTRIBUTES`), exists on
the installed lane with the shape vlguard relies on. A hook whose target moved must fail here, on every lane
(the 0.34.0 front lane included: it runs no engine, so this is where its engine-side targets are checked),
not do nothing at run time. The names moved between versions that :mod:`server.vllm_hooks.locations` resolves are
checked by ``test_compat``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from server.vllm_hooks import GPU_MODEL_RUNNERS, INSTANCE_ATTRIBUTES, TARGETS

CALLABLES = [(t.module, t.qualname, t.params, t.hook) for t in TARGETS]
INSTANCE_ATTRS = [(a.module, a.cls, a.attr, a.hook) for a in INSTANCE_ATTRIBUTES]


def _resolve(module: str, qualname: str) -> Any:
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


@pytest.mark.parametrize(("module", "qualname", "params", "user"), CALLABLES, ids=[c[1] for c in CALLABLES])
def test_each_wrapped_vllm_callable_is_there_with_its_parameters(
    module: str, qualname: str, params: tuple[str, ...], user: str
) -> None:
    target = _resolve(module, qualname)
    assert callable(target), f"{module}.{qualname} ({user}) is not callable"
    found = list(inspect.signature(target).parameters)
    missing = [p for p in params if p not in found]
    assert not missing, f"{module}.{qualname} ({user}) lacks {missing}: it takes {found}"


@pytest.mark.parametrize(
    ("module", "cls", "attr", "user"), INSTANCE_ATTRS, ids=[f"{a[1]}.{a[2]}" for a in INSTANCE_ATTRS]
)
def test_each_instance_attribute_vlguard_reaches_is_set_by_vllm(module: str, cls: str, attr: str, user: str) -> None:
    klass = _resolve(module, cls)
    sources = []
    for base in klass.__mro__:
        if base.__module__.startswith("vllm") and "__init__" in base.__dict__:
            sources.append(inspect.getsource(base.__init__))
    assert any(f"self.{attr} =" in src or f"self.{attr}:" in src for src in sources), (
        f"{module}.{cls} no longer sets self.{attr} in __init__ ({user})"
    )


def test_the_model_runner_still_keeps_a_pending_execute_state() -> None:
    """Soft recovery (``server/vllm_hooks/engine_core.py``) clears the model runner's
    ``execute_model_state`` after a failed step (vLLM refuses the next ``execute_model`` while it is set).
    Checked in the source of the GPU model runner (the production one; found without importing it, which
    needs a GPU build on some lanes)."""
    import importlib.util
    from pathlib import Path

    for name in GPU_MODEL_RUNNERS:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.origin:
            assert "execute_model_state" in Path(spec.origin).read_text(), f"{name} has no execute_model_state"
            return
    pytest.fail(f"no GPU model runner at {GPU_MODEL_RUNNERS}")


def test_vlguard_serve_finds_every_start_up_target_on_this_lane() -> None:
    """What ``vlguard serve`` checks before it builds an engine (it refuses to start otherwise)."""
    from server.vllm_hooks import missing_hooks, preflight

    assert preflight() == {}
    assert missing_hooks() == {}


def test_a_missing_start_up_target_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import server.vllm_hooks as hooks

    gone = hooks.Target("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop_renamed", ("self",), "x:y")
    monkeypatch.setattr(hooks, "TARGETS", (*hooks.TARGETS, gone))
    assert list(hooks.missing_hooks()) == ["vllm.v1.engine.core.EngineCoreProc.run_busy_loop_renamed"]
