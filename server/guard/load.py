"""What the engine is doing now, measured where its outputs arrive in this API process (admission's input).

vLLM's ``OutputProcessor`` keeps one ``RequestState`` per request inside the engine (``request_states``,
``is_prefilling`` until its first token, ``prompt_len``). :meth:`EngineLoad.attach` wraps its
``process_outputs`` (one call per engine step) to see, before vLLM updates them, which requests leave the
prefill phase in this step (their *starts*), how many tokens the step generated and which requests
finished. From that:

- the queue now: requests still in prefill and their prompt tokens (vLLM 0.32's ``max_num_queued_tokens``
  counts the same), requests unfinished (its ``max_num_queued_reqs``);
- the start rate: the most recent starts (at most :data:`RECENT_STARTS`, at most :data:`RECENT_S` old)
  over the time from the oldest of them to now, so a stalled engine's rate falls while nothing starts;
  likewise prompt tokens started a second;
- the service time: an average of the time from a request's start to its finish;
- tokens generated for requests that ended without finishing (aborted: their caller went, or a deadline
  passed), the waste a disconnect should cut short.

With ``--api-server-count N`` each API process measures its own requests: its queue and its rates are
its share, so their ratio (the expected wait) is the server's.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.metrics import definitions as m
from server.vllm_hooks import async_llm

#: Starts the rates are measured over at most, and how old the oldest may be (seconds).
RECENT_STARTS, RECENT_S = 64, 30.0
#: Weight of the newest service time in the running average.
SERVICE_WEIGHT = 0.2
#: Seconds between sweeps for requests that left without finishing.
SWEEP_S = 1.0


@dataclass(frozen=True)
class Queue:
    """The engine's queue as this API process sees it now.

    Attributes:
        waiting: requests in the prefill phase (no token yet), each sample of an ``n > 1`` request counted.
        queued_tokens: their prompt tokens.
        unfinished: requests inside the engine (waiting or running).
    """

    waiting: int = 0
    queued_tokens: int = 0
    unfinished: int = 0


class EngineLoad:
    """Rates and queue of the current engine (see the module docstring).

    Arguments:
        clock: monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.processes = 1  # API processes sharing the engine's batch (--api-server-count)
        self._batch = 0  # the engine's running slots (max_num_seqs; 0: unknown)
        self._processor: Any = None  # the current engine's OutputProcessor
        self._starts: collections.deque[tuple[float, int]] = collections.deque(maxlen=RECENT_STARTS)
        self._running: dict[str, list[float]] = {}  # request id -> [start time, tokens generated]
        self._service_s = 0.0
        self._swept = 0.0
        self._waiting_since: float | None = None  # since the queue last became non-empty
        self._rate = (0.0, 0.0)  # the last rate measured (a prior once the recent starts have aged out)

    def attach(self, processor: Any, batch: int = 0) -> None:
        """Measure the engine whose ``OutputProcessor`` is ``processor`` and that runs ``batch`` requests at
        once (``max_num_seqs``; 0: unknown) from now on (a new engine after a rebuild: what the old one ran
        is forgotten)."""
        self._processor, self._batch = processor, batch
        self._running.clear()

        def observed(original: Callable[..., Any]) -> Callable[..., Any]:
            def process_outputs(engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
                if processor is self._processor:
                    self.observe(engine_core_outputs, processor.request_states)
                return original(engine_core_outputs, *args, **kwargs)

            return process_outputs

        async_llm.wrap_output_processing(processor, observed)

    def observe(self, outputs: list[Any], states: dict[str, Any]) -> None:
        """One engine step's ``EngineCoreOutput`` objects, before vLLM processes them (``states``: the
        output processor's request states, by request id)."""
        now = self._clock()
        for output in outputs:
            rid, new = output.request_id, len(output.new_token_ids)
            running = self._running.get(rid)
            if running is None:
                state = states.get(rid)
                if state is None or not new or not getattr(state, "is_prefilling", False):
                    continue
                self._starts.append((now, int(getattr(state, "prompt_len", 0) or 0)))
                running = self._running[rid] = [now, 0.0]
            running[1] += new
            if output.finish_reason is not None:
                del self._running[rid]
                took = now - running[0]
                average = self._service_s
                self._service_s = average + SERVICE_WEIGHT * (took - average) if average else took
        if now - self._swept >= SWEEP_S:
            self._sweep(states, now)

    def sweep(self) -> None:
        """Count the tokens of requests aborted since the last sweep now (``/metrics`` calls it: an engine
        left idle by the abort produces no output that would sweep)."""
        states = getattr(self._processor, "request_states", None)
        if states is not None:
            self._sweep(states, self._clock())

    def _sweep(self, states: dict[str, Any], now: float) -> None:
        """Requests vLLM no longer holds that never finished were aborted: their tokens were spent for
        nobody."""
        self._swept = now
        gone = [rid for rid in self._running if rid not in states]
        wasted = sum(self._running.pop(rid)[1] for rid in gone)
        if wasted:
            m.ABORTED_TOKENS.inc(wasted)

    def queue(self) -> Queue:
        """The queue now (empty without an engine)."""
        states = getattr(self._processor, "request_states", None)
        if not states:
            return Queue()
        waiting = tokens = 0
        for state in list(states.values()):
            if getattr(state, "is_prefilling", False):
                waiting += 1
                tokens += int(getattr(state, "prompt_len", 0) or 0)
        if not waiting:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = self._clock()
        return Queue(waiting, tokens, len(states))

    def start_rate(self) -> tuple[float, float]:
        """(requests, prompt tokens) leaving the prefill phase a second, over the recent starts (read
        :meth:`queue` first: whether requests wait now counts); when none
        started within :data:`RECENT_S` seconds, the last rate measured ((0, 0): never)."""
        now = self._clock()
        while self._starts and now - self._starts[0][0] > RECENT_S:
            self._starts.popleft()
        if self._starts:
            # The starts after the oldest step's, over the time from that step to the newest start, plus
            # the time requests have waited since then with none started (idle time, with nothing waiting,
            # does not dilute it). Starts come in batches (a step starts several): counting the first
            # step's would count one batch too many. All in one step: over the time since, as a floor.
            first, last = self._starts[0][0], self._starts[-1][0]
            later = [tokens for at, tokens in self._starts if at > first]
            stall = now - max(last, self._waiting_since) if self._waiting_since is not None else 0.0
            if later:
                span = last - first + stall
                self._rate = (len(later) / span, sum(later) / span)
            else:
                span = max(now - first, 0.1)
                self._rate = (len(self._starts) / span, sum(t for _, t in self._starts) / span)
        return self._rate

    def expected_wait(self, queue: Queue | None = None) -> float:
        """Seconds a request arriving now can expect to wait before its prefill ends: the requests (and
        prompt tokens) ahead of it over the rate they have been leaving the queue, the larger of the two;
        0 with nothing waiting, or when the waiting requests fit the batch's free slots (this API process's
        share of them): they start at the next step whatever rate an engine with little to do showed. With
        no start within :data:`RECENT_S` seconds, never less than how long requests have now been waiting
        (an engine that takes no work is refused); before any rate was measured (a new server's first
        burst), that alone."""
        queue = queue or self.queue()
        if not queue.waiting:
            return 0.0
        requests_s, tokens_s = self.start_rate()
        since = self._waiting_since
        stalled = self._clock() - since if since is not None and not self._starts else 0.0
        free = self._batch // max(1, self.processes) - (queue.unfinished - queue.waiting) if self._batch else 0
        if requests_s <= 0 or queue.waiting <= free:
            return stalled
        by_tokens = queue.queued_tokens / tokens_s if tokens_s > 0 else 0.0
        return max(queue.waiting / requests_s, by_tokens, stalled)

    def service_s(self) -> float:
        """Average seconds from a request's start to its finish (0 before any finished)."""
        return self._service_s
