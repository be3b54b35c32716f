"""The contact layer (:mod:`server.vllm_hooks`): a hook whose target is gone fails loudly, a hook installs
once, and nothing outside the layer monkeypatches vLLM or imports a private vLLM name (read from the
source, so a new hook written elsewhere fails here)."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

import server.vllm_hooks as hooks
from server.vllm_hooks import INSTANCE_ATTRIBUTES, TARGETS, HookTargetMissing, wrap

SERVER = Path(__file__).resolve().parents[2] / "server"
LAYER = SERVER / "vllm_hooks"
#: attributes a hook replaces on vLLM's objects: assigned only inside the layer
HOOKED = {t.qualname.rsplit(".", 1)[-1] for t in TARGETS} | {"step_fn", "get_output_async", "renderer"}
#: ``setattr`` calls outside the layer that set no vLLM attribute: (file, first argument's source)
OWN_SETATTR = {("serve.py", "result"), ("app.py", "app.state")}


def test_a_hook_whose_target_is_gone_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "_missing", {})  # what vlguard serve checks before it builds an engine
    with pytest.raises(HookTargetMissing, match=r"vllm\.nowhere\.f not found"):
        wrap(types.SimpleNamespace(), "f", lambda original: original, "vllm.nowhere.f")
    assert issubclass(HookTargetMissing, ImportError)  # callers that fall back on ImportError still do
    assert list(hooks._missing) == ["vllm.nowhere.f"]  # however the caller handled it
    with pytest.raises(HookTargetMissing):
        wrap(types.SimpleNamespace(), "g", lambda original: original, "an.instance.g", once=False)
    assert list(hooks._missing) == ["vllm.nowhere.f"]  # an instance's hook raises where the engine is built


def test_a_hook_installs_once_on_a_class_and_again_on_an_instance() -> None:
    calls: list[str] = []

    class Target:
        def f(self) -> str:
            return "f"

    def make(original: object) -> object:
        def wrapped(self: Target) -> str:
            calls.append("hook")
            return original(self)  # type: ignore[operator]

        return wrapped

    first = wrap(Target, "f", make, "Target.f")
    again = wrap(Target, "f", make, "Target.f")
    assert first is again
    assert Target().f() == "f" and calls == ["hook"]  # not wrapped twice

    def make_bound(original: object) -> object:
        def wrapped() -> str:
            calls.append("instance")
            return original()  # type: ignore[operator]

        return wrapped

    one = Target()
    wrap(one, "f", make_bound, "Target.f", once=False)
    wrap(one, "f", make_bound, "Target.f", once=False)
    assert one.f() == "f" and calls == ["hook", "instance", "instance", "hook"]


@pytest.mark.parametrize("hook", sorted({t.hook.split(" ")[0] for t in [*TARGETS, *INSTANCE_ATTRIBUTES]}))
def test_every_listed_hook_exists_in_vlguard(hook: str) -> None:
    module, _, function = hook.partition(":")
    found = importlib.import_module(module)
    if function:
        assert callable(getattr(found, function, None)), f"{hook} is listed in server.vllm_hooks but not defined"


def _outside_the_layer() -> list[Path]:
    return [p for p in SERVER.rglob("*.py") if LAYER not in p.parents]


def test_nothing_outside_the_layer_assigns_a_hooked_vllm_attribute_or_calls_setattr_on_vllm() -> None:
    found = []
    for path in _outside_the_layer():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                own = isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self"
                if isinstance(target, ast.Attribute) and target.attr in HOOKED and not own:
                    found.append(f"{path.relative_to(SERVER)}:{node.lineno}: .{target.attr} =")
            is_setattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
            first = ast.unparse(node.args[0]) if is_setattr else ""  # type: ignore[attr-defined]
            if is_setattr and (path.name, first) not in OWN_SETATTR:
                found.append(f"{path.relative_to(SERVER)}:{node.lineno}: setattr({first}, ...)")
    assert found == [], "vLLM hooked outside server/vllm_hooks:\n" + "\n".join(found)


def test_nothing_outside_the_layer_calls_wrap() -> None:
    """A hook written outside the layer (``wrap(...)`` on any object, vLLM's or a bench's) fails here: each
    one belongs in :mod:`server.vllm_hooks`, listed in ``TARGETS`` with why it exists and when it can go."""
    found = []
    for path in _outside_the_layer():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("server.vllm_hooks"):
                found += [f"{path.relative_to(SERVER)}:{node.lineno}: imports {a.name}" for a in node.names
                          if a.name in ("wrap", "MARK")]  # fmt: skip
            if isinstance(node, ast.Attribute) and node.attr == "wrap" and ast.unparse(node.value).endswith("hooks"):
                found.append(f"{path.relative_to(SERVER)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "hooks installed outside server/vllm_hooks:\n" + "\n".join(found)


def test_every_target_says_why_it_exists_and_when_it_can_go() -> None:
    vague = [f"{t.module}.{t.qualname}" for t in TARGETS if len(t.why) < 20 or len(t.until) < 10]
    assert vague == []
    bench = {t.qualname for t in TARGETS if t.bench}
    assert bench and all(t.hook.startswith("server.vllm_hooks.bench") for t in TARGETS if t.bench)


def test_nothing_outside_the_layer_imports_a_private_vllm_name() -> None:
    found = []
    for path in _outside_the_layer():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                parts = [p for p in (node.module or "").split(".") if p.startswith("_")]
                if private or parts:
                    found.append(f"{path.relative_to(SERVER)}:{node.lineno}: from {node.module} import {private}")
    assert found == [], "private vLLM names imported outside server/vllm_hooks:\n" + "\n".join(found)


def test_internal_requests_are_processed_apart_without_stats() -> None:
    """keep_out_of_client_stats: a batch holding a probe is processed as two calls, the client requests'
    with the step's stats and the probe's with none; the results are merged; a batch without one is one
    call, untouched."""
    from server.vllm_hooks.async_llm import keep_out_of_client_stats

    calls: list[tuple[list[str], object]] = []

    class Processor:
        def process_outputs(self, outputs: list[types.SimpleNamespace], timestamp: float, stats: object) -> object:
            ids = [o.request_id for o in outputs]
            calls.append((ids, stats))
            return types.SimpleNamespace(request_outputs=[f"out-{i}" for i in ids], reqs_to_abort=ids[:1])

    proc, stats = Processor(), object()
    keep_out_of_client_stats(proc, lambda rid: rid.startswith("probe"))
    batch = [types.SimpleNamespace(request_id=r) for r in ("a", "probe-1-x", "b")]
    done = proc.process_outputs(batch, 1.0, stats)
    assert calls == [(["a", "b"], stats), (["probe-1-x"], None)]
    assert done.request_outputs == ["out-a", "out-b", "out-probe-1-x"]
    assert done.reqs_to_abort == ["a", "probe-1-x"]
    calls.clear()
    proc.process_outputs(batch[:1], 1.0, stats)
    proc.process_outputs(batch, 1.0, None)  # stats off (--disable-log-stats): nothing to keep apart
    assert calls == [(["a"], stats), (["a", "probe-1-x", "b"], None)]
