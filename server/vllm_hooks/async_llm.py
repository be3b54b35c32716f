"""Hooks on vLLM's ``AsyncLLM`` and its serving classes (API process).

- the engine-core output stream: the hang clock's signal (:func:`on_engine_core_output`);
- output processing: one request's fault confined to it (:func:`wrap_output_processing`,
  :func:`deliver_fault`);
- the renderer every engine of a server serves with (:class:`ServingRenderer`);
- the engine-core processes, and what stopping a dead engine takes (:func:`engine_core_pids`,
  :func:`stop_engine_clients`);
- the completion route's request rendering (:func:`wrap_completion_rendering`).

Targets and the attributes read are listed in :data:`server.vllm_hooks.TARGETS` and
:data:`server.vllm_hooks.INSTANCE_ATTRIBUTES`; checked on vLLM 0.20.0, 0.22.1, 0.32.0 and 0.34.0.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from server.vllm_hooks import wrap

#: vLLM's AsyncLLM, or a test's fake with the same surface.
Engine = Any


def engine_core_pids(engine: Engine) -> list[int]:
    """PIDs of the engine-core processes of an ``AsyncLLM``
    (``engine.engine_core.resources.engine_manager.processes``; those of its
    :class:`~server.guard.lifecycle.Placement` when another process launched them; empty when not found: a
    fake engine)."""
    if (placement := getattr(engine, "vlguard_placement", None)) is not None:
        return list(placement.pids)
    with contextlib.suppress(AttributeError):
        manager = engine.engine_core.resources.engine_manager
        return [p.pid for p in manager.processes if p.pid is not None]
    return []


def on_engine_core_output(engine: Engine, callback: Callable[[], None]) -> bool:
    """Call ``callback`` each time the API process receives one batch of outputs from the engine core.

    Wraps ``engine.engine_core.get_output_async`` on the instance (``AsyncLLM``'s output handler looks it
    up on every iteration; vLLM 0.20.0-0.34.0).

    Returns:
        ``False`` when ``engine`` has no engine-core client (a test's fake engine): nothing wrapped.
    Raises:
        HookTargetMissing: the client has no ``get_output_async`` (an unsupported vLLM version).
    """
    client = getattr(engine, "engine_core", None)
    if client is None:
        return False

    def signal(receive: Callable[..., Any]) -> Callable[..., Any]:
        async def get_output_async(*args: Any, **kwargs: Any) -> Any:
            outputs = await receive(*args, **kwargs)
            callback()
            return outputs

        return get_output_async

    wrap(client, "get_output_async", signal, "EngineCoreClient.get_output_async", once=False)
    return True


def max_num_seqs(engine: Engine) -> int:
    """The engine's ``max_num_seqs`` (requests it runs at once), 0 where it has no ``vllm_config``."""
    config = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    return int(getattr(config, "max_num_seqs", 0) or 0)


def output_processor_of(engine: Engine) -> Any:
    """``engine.output_processor`` (vLLM's ``OutputProcessor``), or None (a test's fake engine)."""
    return getattr(engine, "output_processor", None)


def wrap_output_processing(processor: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``processor.process_outputs(engine_core_outputs, ...)`` (vLLM's ``OutputProcessor``, this
    instance) by ``make(original)``.

    Raises:
        HookTargetMissing: no such method (an unsupported vLLM version).
    """
    wrap(processor, "process_outputs", make, "OutputProcessor.process_outputs", once=False)


def keep_out_of_client_stats(processor: Any, internal: Callable[[str], bool]) -> None:
    """vLLM's client series (``vllm:request_success_total``, the token counters, the latency histograms: all
    made from the ``IterationStats`` ``process_outputs`` fills) count no request whose id ``internal`` picks:
    their outputs are processed apart, without stats. vlguard's probes are its own, not client traffic.

    Raises:
        HookTargetMissing: ``processor`` has no ``process_outputs`` (an unsupported vLLM version).
    """

    def apart(original: Callable[..., Any]) -> Callable[..., Any]:
        def process_outputs(outputs: list[Any], timestamp: Any = None, iteration_stats: Any = None, **kw: Any) -> Any:
            ours = [o for o in outputs if internal(o.request_id)] if iteration_stats is not None else []
            if not ours:
                return original(outputs, timestamp, iteration_stats, **kw)
            processed = original([o for o in outputs if not internal(o.request_id)], timestamp, iteration_stats, **kw)
            apart = original(ours, timestamp, None, **kw)
            processed.request_outputs.extend(apart.request_outputs)
            processed.reqs_to_abort.extend(apart.reqs_to_abort)
            return processed

        return process_outputs

    wrap(processor, "process_outputs", apart, "OutputProcessor.process_outputs", once=False)


def deliver_fault(processor: Any, request_id: str, fault: BaseException) -> bool:
    """Put ``fault`` in ``request_id``'s output queue (its ``RequestState.queue``): vLLM's ``generate()``
    then aborts the request in the engine core and raises it. Returns False when the request has no
    queue (finished meanwhile, or an ``LLMEngine``'s)."""
    state = processor.request_states.get(request_id)
    if state is None or getattr(state, "queue", None) is None:
        return False
    state.queue.put(fault)
    return True


def is_processing(processor: Any, request_id: str) -> bool:
    """Whether the output processor still tracks ``request_id`` (not finished, not aborted)."""
    return request_id in processor.request_states


class ServingRenderer:
    """The one renderer vLLM's serving classes use, whichever engine is current.

    vLLM's serving classes render every request with the first engine's renderer (tokenizer, chat template,
    multimodal processor and its processor cache); a rebuilt engine's output handler, started by its first
    request, reports the cache statistics of ``engine.renderer`` (``vllm:mm_cache_*``): :meth:`adopt`
    points that at the renderer in use. A rebuilt engine's own renderer stays with its input processor and
    is shut down with the engine (:meth:`release`).
    """

    def __init__(self) -> None:
        self.renderer: object | None = None

    def adopt(self, engine: Engine) -> None:
        """A new engine serves with the serving renderer (the first engine's becomes it)."""
        if self.renderer is not None:
            engine.renderer = self.renderer

    def keep(self, engine: Engine) -> None:
        """``engine`` is the first to serve: its renderer is the serving one from now on."""
        if self.renderer is None:
            self.renderer = engine.renderer

    def release(self, engine: Engine) -> None:
        """Before ``engine`` is shut down: detach the serving renderer (``AsyncLLM.shutdown``, which its
        ``__del__`` also runs, would stop its executors under the serving classes) and shut down the
        engine's own renderer, if it has one besides."""
        if engine.renderer is self.renderer:
            engine.renderer = None  # AsyncLLM.shutdown skips None
        self.shutdown_own(engine)

    def shutdown_own(self, engine: Engine) -> None:
        """Shut down the renderer ``engine`` built for itself when it serves with another (a rebuilt
        engine: :meth:`adopt`; ``engine.input_processor.renderer``); ``AsyncLLM.shutdown`` only stops
        ``engine.renderer``."""
        own = getattr(getattr(engine, "input_processor", None), "renderer", None)
        if own is not None and own is not self.renderer and own is not engine.renderer:
            with contextlib.suppress(Exception):
                own.shutdown()


def end_client(engine: Engine) -> None:
    """Its engine core is gone, and another process launched it: do what vLLM's engine-core monitor does
    for an engine core its client launched (``MPClient.start_engine_core_monitor``): mark the client's engine
    dead and shut the client down. Its output task then hands ``EngineDeadError`` to every request inside.
    Callable from any thread (vLLM's client closes its sockets on its own loop). Never raises."""
    if (core := getattr(engine, "engine_core", None)) is None:
        return
    with contextlib.suppress(Exception):
        core.resources.engine_dead = True
        core.shutdown()


#: How long a dead remote engine's output handler gets to hand ``EngineDeadError`` to its requests (seconds).
END_CLIENT_WAIT_S = 5.0


async def stop_engine_clients(engine: Engine) -> None:
    """After its engine core died: cancel ``engine``'s output handler task and shut its engine-core client
    down (its sockets; off the event loop). An engine another process launched is first ended as vLLM's
    monitor would (:func:`end_client`), and its output handler given :data:`END_CLIENT_WAIT_S` to fail its
    requests (cancelled, it would leave them waiting). Never raises."""
    handler = getattr(engine, "output_handler", None)
    if getattr(engine, "vlguard_placement", None) is not None:
        end_client(engine)
        if handler is not None and not handler.done():
            await asyncio.wait({handler}, timeout=END_CLIENT_WAIT_S)
    if handler is not None:
        handler.cancel()
    if (core := getattr(engine, "engine_core", None)) is not None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(core.shutdown)


def wrap_completion_rendering(serving: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``render_completion_request(request, ...)`` of vLLM's ``OpenAIServingCompletion`` instance
    ``serving`` by ``make(original)``.

    Raises:
        HookTargetMissing: ``serving`` has no such method (an unsupported vLLM version).
    """
    wrap(serving, "render_completion_request", make, "OpenAIServingCompletion.render_completion_request", once=False)
