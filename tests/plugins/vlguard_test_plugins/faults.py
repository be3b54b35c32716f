"""Real faults inside the real engine, for guard tests (inert unless their variables are set).

``VLGUARD_TEST_POISON_TOKENS="12,34,56"``: the model runner raises whenever a newly scheduled request's
prompt contains that token-id sequence, in the worker process, so the engine core dies exactly as it
does on a real model error (a poison request).

``VLGUARD_TEST_POISON_EXIT_TOKENS="12,34"``: the same, but the worker process exits at once (``os._exit``)
instead of raising: a poison input that crashes its process outright (a segfault in a kernel, say).

``VLGUARD_TEST_FAIL_START_IF=/path``: an engine whose processes start while that file exists fails
during start-up (plugin loading raises in the engine core), so in-process restarts keep failing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

POISON_ENV = "VLGUARD_TEST_POISON_TOKENS"
POISON_EXIT_ENV = "VLGUARD_TEST_POISON_EXIT_TOKENS"
FAIL_START_ENV = "VLGUARD_TEST_FAIL_START_IF"
logger = logging.getLogger("vllm.vlguard.test_faults")


def contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def register() -> None:
    flag = os.environ.get(FAIL_START_ENV)
    if flag and os.path.exists(flag) and "EngineCore" in _process_title():
        raise RuntimeError(f"vlguard test fault: engine start-up fails while {flag} exists")
    raise_on = _needle(POISON_ENV)
    exit_on = _needle(POISON_EXIT_ENV)
    if not raise_on and not exit_on:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model
    if getattr(original, "__vlguard_test_fault__", False):
        return

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        for req in getattr(scheduler_output, "scheduled_new_reqs", []):
            ids = list(req.prompt_token_ids or [])
            if exit_on and contains(ids, exit_on):
                os._exit(13)  # the worker process dies in the middle of the step
            if raise_on and contains(ids, raise_on):
                raise RuntimeError("vlguard test fault: poison request reached the model")
        return original(self, scheduler_output, *args, **kwargs)

    execute_model.__vlguard_test_fault__ = True  # type: ignore[attr-defined]
    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]
    logger.warning("vlguard test plugin: requests containing tokens %s crash the model, %s its process",
                   raise_on, exit_on)  # fmt: skip


def _needle(env: str) -> list[int]:
    value = os.environ.get(env)
    return [int(t) for t in value.split(",")] if value else []


def _process_title() -> str:
    try:
        import setproctitle

        return str(setproctitle.getproctitle())
    except Exception:
        return ""
