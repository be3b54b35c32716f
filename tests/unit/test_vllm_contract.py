"""Every vLLM function vlguard wraps or replaces, and every vLLM attribute it reaches into, exists on the
installed lane with the shape vlguard relies on. A hook whose target moved must fail here, on every lane
(the 0.34.0 front lane included: it runs no engine, so this is where its engine-side targets are checked),
not do nothing at run time. The names moved between versions that :mod:`server.compat` resolves are
checked by ``test_compat``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

CORE, SCHED, KV = "vllm.v1.engine.core", "vllm.v1.core.sched.scheduler", "vllm.v1.core.kv_cache_manager"
QWEN = "vllm.model_executor.models.qwen3_vl"
QWEN_VL = "Qwen3VLForConditionalGeneration"

#: (module, qualified name, parameters the hook passes or reads, who relies on it: a path under server/)
CALLABLES: list[tuple[str, str, tuple[str, ...], str]] = [
    (CORE, "EngineCoreProc.run_busy_loop", ("self",), "guard/fatal.py: fatal recorder"),
    (CORE, "EngineCore.add_request", ("self", "request"), "guard/soft.py: soft recovery"),
    (CORE, "EngineCore.step", ("self",), "guard/soft.py (step_fn is step or its batch-queue twin)"),
    (CORE, "EngineCore.reset_encoder_cache", ("self",), "guard/soft.py: caches after a fault"),
    (SCHED, "Scheduler.schedule", ("self",), "guard/fatal.py: step log"),
    (SCHED, "Scheduler.update_from_output", ("self", "scheduler_output"), "guard/fatal.py: step log"),
    (SCHED, "Scheduler.finish_requests", ("self",), "guard/soft.py: cut requests"),
    (SCHED, "Scheduler._update_after_schedule", ("self", "scheduler_output"), "alignment/scheduler.py"),
    (SCHED, "Scheduler._try_schedule_encoder_inputs", ("self", "request"), "alignment/scheduler.py"),
    (KV, "KVCacheManager.allocate_slots", ("self", "request", "delay_cache_blocks"), "alignment: delayed caching"),
    (KV, "KVCacheManager.cache_blocks", ("self", "request"), "alignment: delayed prefix caching"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs", ("self",), "guard/output_faults.py"),
    ("vllm.model_executor.models.registry", "_ModelRegistry._try_load_model_cls", ("self", "model_arch"), "patches"),
    ("vllm.v1.executor.multiproc_executor", "get_mp_context", (), "guard/spare.py: worker hand-over"),
    ("vllm.v1.engine.utils", "get_mp_context", (), "guard/spare.py: engine-core hand-over"),
    (
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion.render_completion_request",
        ("self", "request"),
        "api/request_fixes.py",
    ),
    (QWEN, f"{QWEN_VL}._get_deepstack_input_embeds", ("self",), "patches/deepstack.py"),
    (QWEN, f"{QWEN_VL}._set_deepstack_input_embeds", ("self",), "patches/deepstack.py"),
    (QWEN, f"{QWEN_VL}._clear_deepstack_input_embeds", ("self",), "patches/deepstack.py"),
]

#: (module, class, attribute its instances get in ``__init__``, who relies on it), read from the source
INSTANCE_ATTRS: list[tuple[str, str, str, str]] = [
    (CORE, "EngineCore", "step_fn", "guard/soft.py wraps it per instance"),
    (CORE, "EngineCore", "scheduler", "guard/fatal.py, guard/soft.py"),
    (CORE, "EngineCore", "model_executor", "guard/soft.py"),
    (CORE, "EngineCoreProc", "output_queue", "guard/soft.py: the cut requests' ERROR outputs"),
    (SCHED, "Scheduler", "requests", "guard/fatal.py: what the scheduler holds"),
    (SCHED, "Scheduler", "kv_cache_manager", "alignment"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "renderer", "guard/supervisor.py: the serving renderer"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "output_processor", "output_faults.py"),
]


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


#: where vLLM's GPU model runner lives, newest first (0.34: a package of its own)
GPU_MODEL_RUNNERS = ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner")


def test_the_model_runner_still_keeps_a_pending_execute_state() -> None:
    """``server/guard/soft.py`` clears the model runner's ``execute_model_state`` after a failed step (vLLM
    refuses the next ``execute_model`` while it is set). Checked in the source of the GPU model runner
    (the production one; found without importing it, which needs a GPU build on some lanes)."""
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
