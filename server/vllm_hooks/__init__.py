"""The one layer that touches vLLM's internals: every vLLM function vlguard wraps or replaces, every vLLM
name it imports that moved between versions or is private, and the instance attributes it reaches into.

Outside this package vlguard uses vLLM's public surface only (its engine arguments, ``AsyncLLM``, the
serving classes and routers, ``SamplingParams``) and the hooks below, by name. When vLLM moves, this is
what to check; ``tests/unit/test_vllm_contract.py`` checks every target of :data:`TARGETS` on each vLLM
lane, and each hook raises :class:`HookTargetMissing` where its target is gone. The per-process hooks
(on classes and modules) are installed in the API process too, when vLLM loads vlguard's plugins there;
``vlguard serve`` then refuses to start when one of them found nothing (:func:`missing_hooks`), rather
than serve without its fatal recorder, soft recovery or backports. A per-instance hook whose object
lacks the target raises where the engine is built (a rebuild then fails, and the restart budget ends
the process).

- :mod:`.locations`: where names that moved live (the argument parser, the error envelope, the app state,
  the processor-cache factories), newest vLLM first;
- :mod:`.engine_core`: the engine core's busy loop, step and admission, its scheduler's step, and the
  operations soft recovery needs (engine-core process);
- :mod:`.async_llm`: the API process's ``AsyncLLM``: its engine-core output stream, output processing,
  renderer, engine-core processes, and the completion route's request rendering;
- :mod:`.processes`: how vLLM starts its engine processes (the spare's hand-over);
- :mod:`.models`: the model registry's class loading and method replacement on model classes (the
  deepstack backports, which stay probe-based: :mod:`server.patches.detect`), and the compile cache load;
- :mod:`.processor_cache`: vLLM's multimodal processor cache in the form replays survive (a vLLM plugin);
- :mod:`.structured_output`: vLLM's xgrammar backend, for the door's compile check, and its cache of
  compiled grammars emptied after each compile (every process);
- :mod:`.media_connector`: vLLM's media connector under vlguard's media policy, and its item trackers
  without client uuids (API process);
- :mod:`.hf_processor`: transformers' check of a processor call's keyword arguments with its compiled
  form kept (a backport; API process);
- :mod:`.bench`: the phase trace's stamps (bench only; serving never imports it).

Each :class:`Target` says what vLLM lacks that its hook stands in for (the upstream issue or PR) and when the
hook can go; nothing outside this package calls :func:`wrap` or sets an attribute on a vLLM object
(``tests/unit/test_vllm_hooks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Set on every wrapper a hook installs: a second install of the same hook is a no-op.
MARK = "__vlguard_hook__"


class HookTargetMissing(ImportError):
    """A hook's vLLM target is not where the hook expects it: an unsupported vLLM version."""


#: per-process hooks (``once``) whose target was missing in this process: target -> message
_missing: dict[str, str] = {}


def missing_hooks() -> dict[str, str]:
    """What vlguard cannot hook in the installed vLLM (``{target: why}``): every start-up target of
    :data:`TARGETS` that is not there (:func:`preflight`), and every per-process hook that found nothing
    in this process, however its caller handled it (the plugins log and go on)."""
    return {**preflight(), **_missing}


def preflight() -> dict[str, str]:
    """The start-up targets of :data:`TARGETS` the installed vLLM lacks (``{target: why}``; imports the
    modules that define them)."""
    missing = {}
    for target in TARGETS:
        if target.at_start:
            try:
                target.resolve()
            except HookTargetMissing as exc:
                missing[f"{target.module}.{target.qualname}"] = str(exc)
    return missing


def wrap(owner: Any, name: str, make: Callable[[Any], Any], target: str, once: bool = True) -> Any:
    """Replace ``owner.name`` (a class, a module or an instance) by ``make(original)``.

    Arguments:
        owner: what holds the function.
        name: the attribute.
        make: builds the replacement from the original.
        target: the qualified vLLM name, for the error.
        once: a second call finds the first replacement and installs nothing (for classes and modules,
            whose hooks are per process); False wraps again (an instance's hooks close over its state).

    Returns:
        The original (the installed replacement's original when it was already installed).
    Raises:
        HookTargetMissing: ``owner`` has no such attribute.
    """
    original = getattr(owner, name, None)
    if original is None:
        message = f"{target} not found: unsupported vLLM version"
        if once:
            _missing[target] = message
        raise HookTargetMissing(message)
    if once and getattr(original, MARK, False):
        return getattr(original, "__wrapped__", original)
    replacement = make(original)
    try:
        setattr(replacement, MARK, True)
        if getattr(replacement, "__wrapped__", None) is None:
            replacement.__wrapped__ = original
    except (AttributeError, TypeError):  # a bound method or builtin: the replacement stays unmarked
        pass
    setattr(owner, name, replacement)
    return original


@dataclass(frozen=True)
class Target:
    """One vLLM function a hook wraps or replaces (or one of transformers', which vLLM's renderer calls).

    Attributes:
        module: where vLLM defines it.
        qualname: ``Class.method`` or ``function``.
        params: the parameters the hook passes or reads.
        hook: the vlguard function that hooks it (``module:function``).
        versions: the vLLM versions it was checked on.
        at_start: checked by ``vlguard serve`` before it builds an engine (:func:`preflight`); the
            deepstack methods are not (the backports probe each model class as it loads).
        why: what vLLM lacks that the hook stands in for: the upstream issue or PR where there is one.
        until: when the hook can go.
        bench: used only by ``vlguard bench`` (the phase trace, the engine scenario), never by serving.
    """

    module: str
    qualname: str
    params: tuple[str, ...]
    hook: str
    versions: str = "0.20.0-0.34.0"
    at_start: bool = True
    why: str = ""
    until: str = ""
    bench: bool = False

    def resolve(self) -> Any:
        """The installed vLLM's target.

        Raises:
            HookTargetMissing: it is not there.
        """
        import importlib

        try:
            found: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError) as exc:
            raise HookTargetMissing(f"{self.module}.{self.qualname} not found ({exc})") from exc
        return found


@dataclass(frozen=True)
class InstanceAttribute:
    """An attribute of a vLLM object that vlguard reads or replaces (set in the class's ``__init__``)."""

    module: str
    cls: str
    attr: str
    hook: str


CORE, SCHED, KV = "vllm.v1.engine.core", "vllm.v1.core.sched.scheduler", "vllm.v1.core.kv_cache_manager"
QWEN, QWEN_VL = "vllm.model_executor.models.qwen3_vl", "Qwen3VLForConditionalGeneration"
_EC, _AL, _MD = "server.vllm_hooks.engine_core", "server.vllm_hooks.async_llm", "server.vllm_hooks.models"
_OP = "vllm.v1.engine.output_processor"
_SO, _BN = "server.vllm_hooks.structured_output", "server.vllm_hooks.bench"
GRAMMAR, CHAT = "vllm.v1.structured_output.backend_xgrammar", "vllm.entrypoints.openai.chat_completion.serving"

#: Why each group of hooks exists (:attr:`Target.why`) and when it can go (:attr:`Target.until`).
_SOFT = (
    "vLLM has no recovery from an exception inside one engine step: the engine core dies with every request "
    "(0.34's --enable-fault-tolerance aborts them all and waits for an operator) and names no request",
    "vLLM absorbs a step fault inside the live engine core and names the request it was handling",
)
_ALIGN = (
    "vllm#41485: a step carrying image tokens padded to a capture size reads the deepstack buffer past what "
    "was written",
    "every supported vLLM has the deepstack fixes (vllm PR #40932, 0.20.2; vllm PR #43617, 0.23.0)",
)
_DEEPSTACK = (
    "vllm#41485 (the padded read raises; fixed by vllm PR #40932) and the compiled graph traced without "
    "deepstack (an empty buffer returns None; fixed by vllm PR #43617)",
    "every supported vLLM is 0.23.0 or later (the probes then patch nothing already)",
)
_SPARE = (
    "vLLM spawns a fresh engine core and worker at every engine build (a cold import of torch and vLLM)",
    "vLLM restarts or keeps a warm engine core itself",
)
_GRAMMAR = (
    "vllm#43920: a grammar the engine's backend cannot compile kills the engine core (engine-side fix: vllm PR #47312)",
    "every supported vLLM has vllm PR #47312",
)
_GRAMMAR_CACHE = (
    "xgrammar's cache of compiled grammars is bounded by VLLM_XGRAMMAR_CACHE_MB but the process is not: "
    "distinct constraints grow the engine core ~1.6 MB each",
    "vLLM or xgrammar bound the memory compiled grammars hold",
)
_MEDIA = (
    "vLLM's media connector fetches any http(s) URL (remote media has no off switch), decodes images and video "
    "frames of any size, and takes a request's media_io_kwargs (num_frames -1, video_backend) and media uuids "
    "(vllm#55547) as given",
    "vLLM bounds media before decoding, can refuse remote media, and bounds per-request media_io_kwargs",
)
_HF_SCHEMA = (
    "transformers#45807: transformers 5.6.2 (vLLM 0.20.0, 0.22.1) merges a new TypedDict at every processor call, "
    "so huggingface_hub builds and compiles a strict dataclass to check each call's keyword arguments",
    "every supported vLLM installs a transformers with PR #45807 (5.19.0 has it)",
)
_TRACE = ("the phase trace stamps vLLM's request path (bench only)", "vLLM traces its request phases itself")

#: Every vLLM function (and transformers function) a hook wraps, replaces or relies on the shape of.
TARGETS: tuple[Target, ...] = (
    Target(CORE, "EngineCoreProc.run_busy_loop", ("self",), f"{_EC}:wrap_busy_loop", why=_SOFT[0], until=_SOFT[1]),
    Target(CORE, "EngineCore.add_request", ("self", "request"), f"{_EC}:guard_step_and_admission", why=_SOFT[0],
           until=_SOFT[1]),
    Target(CORE, "EngineCore.step", ("self",), f"{_EC}:guard_step_and_admission (step_fn: step or its twin)",
           why=_SOFT[0], until=_SOFT[1]),
    Target(CORE, "EngineCore.reset_encoder_cache", ("self",), f"{_EC}:reset_caches", why=_SOFT[0], until=_SOFT[1]),
    Target(SCHED, "Scheduler.schedule", ("self",), f"{_EC}:watch_scheduler_steps", why=_SOFT[0], until=_SOFT[1]),
    Target(SCHED, "Scheduler.update_from_output", ("self", "scheduler_output"), f"{_EC}:watch_scheduler_steps",
           why=_SOFT[0], until=_SOFT[1]),
    Target(SCHED, "Scheduler.finish_requests", ("self",), f"{_EC}:finish_every_request", why=_SOFT[0],
           until=_SOFT[1]),
    Target(SCHED, "Scheduler.reset_prefix_cache", ("self",), f"{_EC}:reset_caches", why=_SOFT[0], until=_SOFT[1]),
    Target("vllm.v1.engine.core_client", "AsyncMPClient.get_output_async", ("self",), f"{_AL}:on_engine_core_output",
           why="a stopped or deadlocked engine core goes unnoticed: stock /health reads an errored flag only",
           until="vLLM reports engine-core progress (a hang watchdog of its own)"),
    Target(SCHED, "Scheduler._update_after_schedule", ("self", "scheduler_output"), "server.alignment.scheduler",
           why=_ALIGN[0], until=_ALIGN[1]),
    Target(SCHED, "Scheduler._try_schedule_encoder_inputs", ("self", "request"), "server.alignment.scheduler",
           why=_ALIGN[0], until=_ALIGN[1]),
    Target(KV, "KVCacheManager.allocate_slots", ("self", "request", "delay_cache_blocks"),
           f"{_EC}:delay_block_caching", why=_ALIGN[0], until=_ALIGN[1]),
    Target(KV, "KVCacheManager.cache_blocks", ("self", "request"), "server.alignment (delayed prefix caching)",
           why=_ALIGN[0], until=_ALIGN[1]),
    Target("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs", ("self",),
           f"{_AL}:wrap_output_processing",
           why="an exception while processing one request's output ends the API process's output handler: every "
               "request in flight fails",
           until="vLLM confines an output-processing error to its request"),
    Target("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs",
           ("self", "engine_core_outputs", "engine_core_timestamp", "iteration_stats"),
           f"{_AL}:keep_out_of_client_stats",
           why="vlguard's probes would be counted as client requests in vLLM's request, token and latency series",
           until="vlguard needs no probe (vLLM reports engine-core progress)"),
    Target("vllm.model_executor.models.registry", "_ModelRegistry._try_load_model_cls", ("self", "model_arch"),
           f"{_MD}:on_model_class_load", why=_DEEPSTACK[0], until=_DEEPSTACK[1]),
    Target("vllm.v1.executor.multiproc_executor", "get_mp_context", (), "server.vllm_hooks.processes:route_starts",
           why=_SPARE[0], until=_SPARE[1]),
    Target("vllm.v1.engine.utils", "get_mp_context", (), "server.vllm_hooks.processes:route_starts",
           why=_SPARE[0], until=_SPARE[1]),
    Target("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion.render_completion_request",
           ("self", "request"), f"{_AL}:wrap_completion_rendering",
           why='/v1/completions with "max_tokens": null ends in a 500 (0.20.0, 0.22.1)',
           until="every supported vLLM normalises a null max_tokens (0.32.0 does)"),
    Target("vllm.multimodal.media.connector", "MediaConnector.load_from_url", ("self", "url", "media_io"),
           "server.vllm_hooks.media_connector:install", why=_MEDIA[0], until=_MEDIA[1]),
    Target("vllm.multimodal.media.connector", "MediaConnector.load_from_url_async", ("self", "url", "media_io"),
           "server.vllm_hooks.media_connector:install", why=_MEDIA[0], until=_MEDIA[1]),
    Target("transformers.processing_utils", "validate_typed_dict", ("schema", "data"),
           "server.vllm_hooks.hf_processor:install", why=_HF_SCHEMA[0], until=_HF_SCHEMA[1]),
    Target(QWEN, f"{QWEN_VL}._get_deepstack_input_embeds", ("self",), f"{_MD}:replace_methods (deepstack)",
           at_start=False, why=_DEEPSTACK[0], until=_DEEPSTACK[1]),
    Target(QWEN, f"{QWEN_VL}._set_deepstack_input_embeds", ("self",), f"{_MD}:replace_methods (deepstack)",
           at_start=False, why=_DEEPSTACK[0], until=_DEEPSTACK[1]),
    Target(QWEN, f"{QWEN_VL}._clear_deepstack_input_embeds", ("self",), f"{_MD}:replace_methods (deepstack)",
           at_start=False, why=_DEEPSTACK[0], until=_DEEPSTACK[1]),
    Target(GRAMMAR, "XgrammarBackend.compile_grammar", ("self",), f"{_SO}:xgrammar_compiler", at_start=False,
           why=_GRAMMAR[0], until=_GRAMMAR[1]),
    Target(GRAMMAR, "XgrammarBackend.compile_grammar", ("self",), f"{_SO}:forget_compiled_grammars",
           why=_GRAMMAR_CACHE[0], until=_GRAMMAR_CACHE[1]),
    Target(GRAMMAR, "validate_xgrammar_grammar", ("sampling_params",), f"{_SO}:xgrammar_compiler", at_start=False,
           why=_GRAMMAR[0], until=_GRAMMAR[1]),
    Target("vllm.v1.structured_output.request", "get_structured_output_key", (), f"{_SO}:xgrammar_compiler",
           at_start=False, why=_GRAMMAR[0], until=_GRAMMAR[1]),
    Target(CHAT, "OpenAIServingChat.create_chat_completion", ("self", "request"), f"{_BN}:wrap_method",
           at_start=False, why=_TRACE[0], until=_TRACE[1], bench=True),
    Target(CHAT, "OpenAIServingChat.render_chat_request", ("self", "request"), f"{_BN}:wrap_method",
           at_start=False, why=_TRACE[0], until=_TRACE[1], bench=True),
    Target(CHAT, "OpenAIServingChat.chat_completion_stream_generator", ("self", "request"), f"{_BN}:wrap_method",
           at_start=False, why=_TRACE[0], until=_TRACE[1], bench=True),
    Target("vllm.v1.engine.async_llm", "AsyncLLM.generate", ("self", "prompt", "sampling_params", "request_id"),
           f"{_BN}:wrap_method", at_start=False, why=_TRACE[0], until=_TRACE[1], bench=True),
)  # fmt: skip

#: Every attribute of a vLLM object a hook reads or replaces per instance.
INSTANCE_ATTRIBUTES: tuple[InstanceAttribute, ...] = (
    InstanceAttribute(CORE, "EngineCore", "step_fn", f"{_EC}:guard_step_and_admission"),
    InstanceAttribute(CORE, "EngineCore", "step_fn", f"{_EC}:time_steps (bench only)"),
    InstanceAttribute(CORE, "EngineCore", "scheduler", f"{_EC}: step log, cut requests"),
    InstanceAttribute(CORE, "EngineCore", "model_executor", f"{_EC}:synchronize_workers"),
    InstanceAttribute(CORE, "EngineCoreProc", "output_queue", f"{_EC}:send_error_finishes"),
    InstanceAttribute(SCHED, "Scheduler", "requests", f"{_EC}: what the scheduler holds"),
    InstanceAttribute(SCHED, "Scheduler", "running", f"{_EC}:finish_every_request (freed requests)"),
    InstanceAttribute(SCHED, "Scheduler", "waiting", f"{_EC}:finish_every_request (freed requests)"),
    InstanceAttribute(CORE, "EngineCore", "batch_queue", f"{_EC}:wait_for_batches"),
    InstanceAttribute(CORE, "EngineCore", "is_pooling_model", f"{_EC}:is_pooling"),
    InstanceAttribute("vllm.v1.engine.async_llm", "AsyncLLM", "engine_core", f"{_AL}:on_engine_core_output"),
    InstanceAttribute(SCHED, "Scheduler", "kv_cache_manager", "server.alignment"),
    InstanceAttribute("vllm.v1.engine.async_llm", "AsyncLLM", "renderer", f"{_AL}: the serving renderer"),
    InstanceAttribute("vllm.v1.engine.async_llm", "AsyncLLM", "output_processor", f"{_AL}:output_processor_of"),
    InstanceAttribute("vllm.v1.engine.async_llm", "AsyncLLM", "vllm_config", f"{_AL}:max_num_seqs"),
    InstanceAttribute(_OP, "OutputProcessor", "request_states", "server.guard.load: the engine's queue"),
    InstanceAttribute(_OP, "RequestState", "is_prefilling", "server.guard.load: a request's start"),
    InstanceAttribute(_OP, "RequestState", "prompt_len", "server.guard.load: queued prompt tokens"),
)

#: Read where present, absent on some lanes (``getattr`` with a default; nothing to check):
#: ``Scheduler.skipped_waiting`` (0.20.0, 0.22.1), ``Scheduler.prev_step_scheduled_req_ids`` (0.20.0-0.32.0),
#: ``EngineCoreClient.resources.engine_manager`` (the engine-core processes; the watchdog then sees none).

#: Where vLLM's GPU model runner lives, newest first (0.34: a package of its own); soft recovery clears
#: its ``execute_model_state`` after a failed step (:func:`server.vllm_hooks.engine_core.synchronize_workers`).
GPU_MODEL_RUNNERS = ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner")
