"""API-process side of fault attribution: an exception while vLLM's output processor handles one request's
output (detokenization, stop strings, logprobs) costs that request, not the engine.

vLLM's ``AsyncLLM`` processes every engine-core output batch in one loop (``OutputProcessor.process_outputs``)
in its output-handler task; an exception there ends the task and fails every request in flight as if the
engine had died (the guard then rebuilt it, charging nobody). :func:`confine` wraps that method on one
engine's output processor: when it raises, the traceback names the request whose output was being
processed (the innermost frame holding vLLM's ``EngineCoreOutput`` or ``RequestState`` for it); that
request alone gets :class:`OutputProcessingFault` in its output queue (vLLM's ``generate()`` then aborts
it in the engine core and raises it to the guard, which charges and carries it over), the outputs before
it stay processed (their engine-side aborts for stop strings are recomputed), and the rest of the batch is
processed as usual. A fault that names no request is re-raised: vLLM's own handling (every request fails,
the guard rebuilds).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from server.engine.step_log import innermost_frames
from server.vllm_hooks import async_llm

logger = logging.getLogger(__name__)

_HOLDERS = ("EngineCoreOutput", "RequestState")


class OutputProcessingFault(RuntimeError):
    """Processing this request's output raised in the API process (``__cause__``: the exception)."""


def output_fault(exc: BaseException) -> OutputProcessingFault | None:
    """The :class:`OutputProcessingFault` behind ``exc`` (vLLM wraps it in ``EngineGenerateError``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OutputProcessingFault):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _named(exc: BaseException) -> str | None:
    """The request id of the innermost traceback frame holding vLLM's per-request output state."""
    for frame in innermost_frames(exc):
        for value in frame.f_locals.values():
            cls = type(value)
            if cls.__name__ in _HOLDERS and cls.__module__.startswith("vllm."):
                request_id = getattr(value, "request_id", None)
                if isinstance(request_id, str):
                    return request_id
    return None


def confine(output_processor: Any) -> None:
    """Wrap ``output_processor.process_outputs`` (this instance) as described in the module docstring.

    Arguments:
        output_processor: vLLM's ``OutputProcessor`` of one ``AsyncLLM`` (API process).
    """
    faulted: collections.deque[str] = collections.deque(maxlen=1024)  # their later outputs are dropped

    def confined(original: Callable[..., Any]) -> Callable[..., Any]:
        def process_outputs(engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
            outputs = (
                [o for o in engine_core_outputs if o.request_id not in faulted] if faulted else engine_core_outputs
            )
            try:
                return original(outputs, *args, **kwargs)
            except Exception as exc:
                culprit = _named(exc)
                at = next((i for i, o in enumerate(outputs) if o.request_id == culprit), None)
                if culprit is None or at is None:
                    raise
                faulted.append(culprit)
                fault = OutputProcessingFault(f"processing the output of request {culprit} failed: {exc!r}"[:500])
                fault.__cause__ = exc
                async_llm.deliver_fault(output_processor, culprit, fault)
                logger.error("processing the output of request %s failed (%s: %s); that request alone is cut",
                             culprit, type(exc).__name__, str(exc)[:300])  # fmt: skip
                # Requests before the culprit were processed: a stop string they met needs an engine-side abort.
                processing = async_llm.is_processing
                aborts = [o.request_id for o in outputs[:at]
                          if not processing(output_processor, o.request_id) and not o.finished]  # fmt: skip
                rest = process_outputs(outputs[at + 1 :], *args, **kwargs)
                rest.reqs_to_abort.extend(aborts)
                return rest

        return process_outputs

    async_llm.wrap_output_processing(output_processor, confined)
