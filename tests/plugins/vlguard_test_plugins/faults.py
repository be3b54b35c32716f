"""Real faults inside the real engine, for guard tests (inert unless their variables are set).

``VLGUARD_TEST_POISON_TOKENS="12,34,56"``: the model runner raises whenever a newly scheduled request's
prompt contains that token-id sequence, in the worker process, so the engine core dies exactly as it
does on a real model error (a poison request).

``VLGUARD_TEST_POISON_EXIT_TOKENS="12,34"``: the same, but the worker process exits at once (``os._exit``)
instead of raising: a poison input that crashes its process outright (a segfault in a kernel, say).

``VLGUARD_TEST_POISON_DEVICE_TOKENS="12,34"``: the model runner raises an exception that reads as a CUDA
error (an illegal memory access): soft recovery must escalate it to a rebuild. With
``VLGUARD_TEST_POISON_DEVICE_ONCE=/path`` only once: the first time creates that file, and while it exists
the request runs normally (a transient device fault: the rebuilt engine serves the replay).

``VLGUARD_TEST_POISON_CORE_TOKENS="12,34"``: the engine core's scheduler raises while processing the
output of a step holding such a request, in the engine-core process (not the worker).

``VLGUARD_TEST_POISON_ADMIT_TOKENS="12,34"``: the scheduler raises while it admits such a request (looking
up its prefix-cache hit inside ``schedule()``), in the engine-core process: a fault outside the model step
that only the request being admitted explains (a grammar that fails to compile faults the same way).

``VLGUARD_TEST_POISON_OUTPUT_TOKENS="12,34"``: the scheduler raises while it processes such a request's
new tokens (``update_from_output``, per request), after a model step that may hold other requests too.

``VLGUARD_TEST_POISON_DETOKENIZE_TOKENS="12,34"``: the API process's output processor raises while it turns
such a request's new tokens into a response (detokenization, stop strings, logprobs), in the API process.

``VLGUARD_TEST_SLOW_STEPS_IF=/path``: while that file exists, every step of the model runner first sleeps
``SLOW_STEP_S``, or the seconds the file holds: requests decode for a known minimum time, so a test can
send a fault while they are in the engine without making them long (the test creates the file, and removes
it when done; it writes a longer step into it to hold the engine nearly still while a fault travels to it).

``VLGUARD_TEST_DROP_MM_CACHE_IF=/path``: while that file exists, the engine core empties its multimodal
receiver cache before adding each request: an image the API side sends as a hash is then missing (the
drift between the two halves of vLLM's split processor cache).

``VLGUARD_TEST_FAIL_START_IF=/path``: an engine whose processes start while that file exists fails
during start-up (plugin loading raises in the engine core), so in-process restarts keep failing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

POISON_ENV = "VLGUARD_TEST_POISON_TOKENS"
POISON_EXIT_ENV = "VLGUARD_TEST_POISON_EXIT_TOKENS"
POISON_DEVICE_ENV = "VLGUARD_TEST_POISON_DEVICE_TOKENS"
POISON_CORE_ENV = "VLGUARD_TEST_POISON_CORE_TOKENS"
POISON_ADMIT_ENV = "VLGUARD_TEST_POISON_ADMIT_TOKENS"
POISON_OUTPUT_ENV = "VLGUARD_TEST_POISON_OUTPUT_TOKENS"
POISON_DETOKENIZE_ENV = "VLGUARD_TEST_POISON_DETOKENIZE_TOKENS"
DEVICE_ONCE_ENV = "VLGUARD_TEST_POISON_DEVICE_ONCE"
FAIL_START_ENV = "VLGUARD_TEST_FAIL_START_IF"
SLOW_STEPS_ENV = "VLGUARD_TEST_SLOW_STEPS_IF"
SLOW_STEP_S = 0.025
DROP_MM_CACHE_ENV = "VLGUARD_TEST_DROP_MM_CACHE_IF"
logger = logging.getLogger("vllm.vlguard.test_faults")


def contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def register() -> None:
    flag = os.environ.get(FAIL_START_ENV)
    if flag and os.path.exists(flag) and "EngineCore" in _process_title():
        raise RuntimeError(f"vlguard test fault: engine start-up fails while {flag} exists")
    raise_on, exit_on, device_on = _needle(POISON_ENV), _needle(POISON_EXIT_ENV), _needle(POISON_DEVICE_ENV)
    slow_flag = os.environ.get(SLOW_STEPS_ENV)
    if raise_on or exit_on or device_on or slow_flag:
        _poison_model_runner(raise_on, exit_on, device_on, slow_flag)
    if core_on := _needle(POISON_CORE_ENV):
        _poison_scheduler(core_on)
    if admit_on := _needle(POISON_ADMIT_ENV):
        _poison_admission(admit_on)
    if output_on := _needle(POISON_OUTPUT_ENV):
        _poison_output(output_on)
    if detokenize_on := _needle(POISON_DETOKENIZE_ENV):
        _poison_detokenizer(detokenize_on)
    if drop_flag := os.environ.get(DROP_MM_CACHE_ENV):
        _drop_mm_cache(drop_flag)


def _new_prompts(scheduler_output: Any) -> list[list[int]]:
    return [list(req.prompt_token_ids or []) for req in getattr(scheduler_output, "scheduled_new_reqs", [])]


def _poison_model_runner(raise_on: list[int], exit_on: list[int], device_on: list[int], slow_flag: str | None) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model
    if getattr(original, "__vlguard_test_fault__", False):
        return

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if slow_flag and (pause := _step_pause(slow_flag)):
            time.sleep(pause)
        for ids in _new_prompts(scheduler_output):
            if exit_on and contains(ids, exit_on):
                os._exit(13)  # the worker process dies in the middle of the step
            if raise_on and contains(ids, raise_on):
                raise RuntimeError("vlguard test fault: poison request reached the model")
            if device_on and contains(ids, device_on) and _first_time(os.environ.get(DEVICE_ONCE_ENV)):
                raise RuntimeError("CUDA error: an illegal memory access was encountered (vlguard test fault)")
        return original(self, scheduler_output, *args, **kwargs)

    execute_model.__vlguard_test_fault__ = True  # type: ignore[attr-defined]
    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]
    logger.warning("vlguard test plugin: requests containing tokens %s crash the model, %s its process, %s "
                   "the device; steps are slow while %s exists", raise_on, exit_on, device_on, slow_flag)  # fmt: skip


def _poison_scheduler(core_on: list[int]) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.update_from_output
    if getattr(original, "__vlguard_test_fault__", False):
        return

    def update_from_output(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if any(contains(ids, core_on) for ids in _new_prompts(scheduler_output)):
            raise RuntimeError("vlguard test fault: the engine core failed processing a step's output")
        return original(self, scheduler_output, *args, **kwargs)

    update_from_output.__vlguard_test_fault__ = True  # type: ignore[attr-defined]
    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    logger.warning("vlguard test plugin: steps holding tokens %s fail in the engine core", core_on)


_MISSING = object()


def _fail_for_prompt(owner: Any, name: str, arg: int, needle: list[int], fault: Callable[[], Exception]) -> None:
    """Wrap ``owner.<name>`` so that it raises ``fault()`` whenever its argument ``arg`` (0: ``self``) is a
    request, or request state, whose prompt holds ``needle``; the failing function is then handed the
    request, as vLLM's own per-request code is."""
    original = getattr(owner, name)
    if getattr(original, "__vlguard_test_fault__", False):
        return

    # ``self`` and ``request`` are named parameters, not ``*args``: the guard names the request a failing
    # function was handed as an argument (server.engine.step_log.named_requests), as it would vLLM's own.
    def wrapper(self: Any, request: Any = _MISSING, *args: Any, **kwargs: Any) -> Any:
        subject = self if arg == 0 else request
        if contains(list(subject.prompt_token_ids or []), needle):
            raise fault()
        given = () if request is _MISSING else (request,)
        return original(self, *given, *args, **kwargs)

    wrapper.__vlguard_test_fault__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _poison_admission(needle: list[int]) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    _fail_for_prompt(KVCacheManager, "get_computed_blocks", 1, needle,
                     lambda: RuntimeError("vlguard test fault: the scheduler failed admitting a request"))  # fmt: skip
    logger.warning("vlguard test plugin: admitting a request holding tokens %s fails in the scheduler", needle)


def _poison_output(needle: list[int]) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    _fail_for_prompt(Scheduler, "_update_request_with_output", 1, needle,
                     lambda: RuntimeError("vlguard test fault: processing a request's output failed"))  # fmt: skip
    logger.warning("vlguard test plugin: processing the output of requests holding tokens %s fails", needle)


def _poison_detokenizer(needle: list[int]) -> None:
    from vllm.v1.engine.output_processor import RequestState

    def fault() -> Exception:
        return UnicodeDecodeError("utf-8", b"\xff", 0, 1, "vlguard test fault: invalid start byte")

    _fail_for_prompt(RequestState, "make_request_output", 0, needle, fault)
    logger.warning("vlguard test plugin: the output of requests holding tokens %s fails in the API process", needle)


def _drop_mm_cache(flag: str) -> None:
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.preprocess_add_request
    if getattr(original, "__vlguard_test_fault__", False):
        return

    def preprocess_add_request(self: Any, request: Any) -> Any:
        if os.path.exists(flag) and getattr(self, "mm_receiver_cache", None) is not None:
            self.mm_receiver_cache.clear_cache()
        return original(self, request)

    preprocess_add_request.__vlguard_test_fault__ = True  # type: ignore[attr-defined]
    EngineCore.preprocess_add_request = preprocess_add_request  # type: ignore[method-assign]


def _step_pause(flag: str) -> float:
    """The seconds each step sleeps: 0 without the flag file, else its number (``SLOW_STEP_S`` when empty)."""
    try:
        with open(flag) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return 0.0
    try:
        return float(text) if text else SLOW_STEP_S
    except ValueError:
        return SLOW_STEP_S


def _first_time(flag: str | None) -> bool:
    """True without a flag file; with one, True only for the call that creates it."""
    if not flag:
        return True
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _needle(env: str) -> list[int]:
    value = os.environ.get(env)
    return [int(t) for t in value.split(",")] if value else []


def _process_title() -> str:
    try:
        import setproctitle

        return str(setproctitle.getproctitle())
    except Exception:
        return ""
