"""The engine client handed to vLLM's OpenAI serving classes: where requests survive engine deaths.

vLLM's serving classes call ``generate()``/``abort()`` and read ``model_config``, ``renderer`` and
friends exactly as on an ``AsyncLLM``; every call goes through the supervisor to whatever engine is
current. When the engine dies under a request:

* nothing sent to the client yet (every non-streaming request, and streams before their first token):
  the request is **replayed** on the new engine with the same prompt, images and sampling parameters;
* a stream that already sent tokens is **resumed**: the new engine continues from the prompt plus the
  tokens already sent, with ``max_tokens`` lowered by as many, so the client's stream goes on without a
  gap or a duplicate (greedy streams are token-identical to uninterrupted ones);
* a stream whose decoding has state that resumption would lose (structured outputs, frequency or
  presence penalties, a seed, stop strings: :mod:`server.guard.rerun`) is **re-run** from its start
  instead; what follows the tokens already sent is handed on once the re-run has produced exactly them,
  else the stream ends with an error event;
* a request that a soft recovery cut (:mod:`server.engine.soft`: the engine finished it with ``ERROR``
  and recorded why) is carried over the same way, onto the same engine; so is one whose output
  processing raised in this process (:mod:`server.guard.output_faults`), charged to it alone;
* a request with a strike (it was in the failing step of an earlier fault) runs on probation, isolated
  (:mod:`server.guard.inflight`), so its next fault is charged to it alone;
* a processed image the current engine core holds is sent as its hash (:mod:`server.guard.ipc_cache`;
  ``n == 1`` requests only); if the engine core turns out not to hold it (its cache drifted), the request
  is sent again whole, once;
* where resuming is impossible (``n > 1``, cumulative outputs, a prompt without token ids) or the
  request is quarantined, the error propagates: a stream then ends with an OpenAI error event.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.guard.clients import current_client
from server.guard.errors import (
    EngineUnavailableError,
    NotResumableError,
    QuarantinedRequestError,
    UnsendableRequestError,
)
from server.guard.forensics import Evidence, current_request
from server.guard.ipc_cache import cache_miss
from server.guard.output_faults import output_fault
from server.guard.port import EnginePort
from server.guard.quarantine import Fingerprint
from server.guard.rerun import Rerun, rerun_params, rerun_reason, seeded_for_rerun
from server.guard.states import EngineState
from server.metrics import definitions as m

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class _Entered:
    """One request's mark: whether it reached the engine client. A mutable cell, so that a task vLLM's
    route runs the handler in (``with_cancellation``: a copy of the request task's context) marks the same
    request the outer task reads."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = False


_ENTERED: contextvars.ContextVar[_Entered | None] = contextvars.ContextVar("vlguard_engine_entered", default=None)


def new_request() -> None:
    """A request enters (the input guard, before vLLM's app): it has not reached the engine client."""
    _ENTERED.set(_Entered())


def engine_entered() -> bool:
    """Whether the request served in this context reached the engine client (marked on the first iteration
    of :meth:`GuardedEngineClient.generate`, in whichever task vLLM's route ran it): an exception vLLM's
    serving layer raised before that came from rendering the client's request (server.api.errors)."""
    mark = _ENTERED.get()
    return mark is not None and mark.value


def _mark_entered() -> None:
    if (mark := _ENTERED.get()) is None:
        _ENTERED.set(mark := _Entered())
    mark.value = True


def resume_input(prompt: Any, sampling_params: Any, sent: list[int]) -> tuple[Any, Any]:
    """The prompt and sampling parameters that continue a request after ``sent`` generated tokens.

    Arguments:
        prompt: the processed engine input (dict with ``prompt_token_ids``; image placeholders stay put).
        sampling_params: the original ``SamplingParams``.
        sent: token ids already delivered to the client.

    Raises:
        NotResumableError: the prompt has no token ids.
    """
    if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
        raise NotResumableError("engine restarted mid-stream and this prompt cannot be resumed")
    resumed = dict(prompt)
    resumed["prompt_token_ids"] = [*prompt["prompt_token_ids"], *sent]
    params = sampling_params.clone()
    if params.max_tokens is not None:
        params.max_tokens = max(1, params.max_tokens - len(sent))
    params.min_tokens = max(0, (params.min_tokens or 0) - len(sent))
    return resumed, params


def _error_finish(output: RequestOutput) -> bool:
    """Whether vLLM finished this request, or one of its ``n > 1`` samples, with ``ERROR`` (soft recovery
    cuts requests that way; the samples' finishes may arrive in separate outputs)."""
    for completion in output.outputs:  # noqa: SIM110 - a loop, not any() over a generator: runs for every output
        if completion.finish_reason == "error":
            return True
    return False


def _unfinish(output: RequestOutput, hold_back: int) -> None:
    """Make a cut request's last output an ordinary one: it may carry tokens of earlier steps (outputs not
    yet read are merged), which are delivered; the finish is not.

    ``hold_back``: the characters vLLM holds back from an unfinished output while a stop string may still
    match (``SamplingParams.output_text_buffer_length``). A finished output releases them, so the cut one
    ends with text an uninterrupted stream would not have sent yet (it may be the start of the stop
    string); they are held back again here, as in every unfinished output, delta or cumulative."""
    output.finished = False
    for completion in output.outputs:
        completion.finish_reason = None
        completion.stop_reason = None
        if hold_back:
            completion.text = completion.text[: max(0, len(completion.text) - hold_back)]


class Outcome(enum.Enum):
    """How one attempt of a request ended."""

    DONE = "done"  # the request ran to its end
    CARRY = "carry"  # its engine died under it, a soft recovery cut it, or its output processing raised
    RESEND = "resend"  # the engine core missed an image sent as its hash: send it again, whole
    RETRY = "retry"  # the engine died while the request waited for it: try again, nothing was sent


@dataclass
class Carry:
    """What one request carries from one attempt to the next.

    Attributes:
        prompt, params: the engine input and sampling parameters as the serving layer handed them (a
            stream with decoding state gets a seed: :func:`server.guard.rerun.seeded_for_rerun`).
        delta, single: a delta stream (``RequestOutputKind.DELTA``); one sample (``n == 1``).
        stateful: a single delta stream with decoding state: re-run, not resumed, after sending tokens.
        sent, sent_text: token ids and text already handed on (single delta streams only).
        yielded: any output was handed on.
        whole: send every processed image with its data (the engine core missed one).
        outcome: how the last attempt ended.
    """

    prompt: Any
    params: Any
    delta: bool
    single: bool
    stateful: bool
    sent: list[int] = field(default_factory=list)
    sent_text: list[str] = field(default_factory=list)
    yielded: bool = False
    whole: bool = False
    outcome: Outcome = Outcome.RETRY

    @classmethod
    def start(cls, prompt: Any, sampling_params: Any) -> Carry:
        from vllm.sampling_params import RequestOutputKind

        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        single = getattr(sampling_params, "n", 1) == 1
        # A stream with decoding state is re-run, not resumed, after sending tokens (a sampling one gets a
        # seed now, so its re-run draws the same tokens).
        stateful = delta and single and rerun_reason(sampling_params) is not None
        params = seeded_for_rerun(sampling_params) if stateful else sampling_params
        return cls(prompt, params, delta, single, stateful)

    def inputs(self) -> tuple[Any, Any, Rerun | None]:
        """The next attempt's prompt and parameters, and the re-run check when it re-runs."""
        if self.sent and self.stateful:
            return self.prompt, rerun_params(self.params), Rerun(self.sent, "".join(self.sent_text))
        if self.sent:
            return (*resume_input(self.prompt, self.params, self.sent), None)
        return self.prompt, self.params, None

    def deliver(self, output: RequestOutput) -> None:
        """``output`` is handed on: it shows the original prompt, and its tokens count as sent."""
        original_ids = self.prompt.get("prompt_token_ids") if isinstance(self.prompt, dict) else None
        if self.sent and original_ids is not None:
            output.prompt_token_ids = original_ids
        if self.delta and self.single and output.outputs:
            self.sent.extend(output.outputs[0].token_ids)
            self.sent_text.append(output.outputs[0].text)
        self.yielded = True

    def how(self) -> str:
        """The log's word for the next attempt."""
        return "replay" if not self.sent else f"{'re-run' if self.stateful else 'resume'} after {len(self.sent)} tokens"


class GuardedEngineClient:
    """Duck-typed ``vllm.engine.protocol.EngineClient`` over the engine owner's current engine.

    Arguments:
        port: the engine's owner (the supervisor), as far as this client may ask it
            (:class:`~server.guard.port.EnginePort`).
    """

    def __init__(self, port: EnginePort) -> None:
        self._port = port
        # The serving layer's request id -> the ids its requests are inside the engine under now. A client
        # chooses the serving layer's id (``X-Request-Id``): two requests with one id go to the engine as
        # two ids (the second with a ``~N`` suffix), so the ledger, fault charging and aborts tell them apart;
        # no id in use is given twice, so a client that picks a suffixed id collides with nobody either.
        self._engine_ids: dict[str, list[str]] = {}
        self._in_engine: set[str] = set()
        self._seq = 0

    def _claim(self, request_id: str) -> str:
        """A fresh engine-side id for a request the serving layer calls ``request_id`` (unique among the
        ids in use)."""
        engine_id = request_id
        while engine_id in self._in_engine:
            self._seq += 1
            engine_id = f"{request_id}~{self._seq}"
        self._engine_ids.setdefault(request_id, []).append(engine_id)
        self._in_engine.add(engine_id)
        return engine_id

    def _release(self, request_id: str, engine_id: str) -> None:
        taken = self._engine_ids.get(request_id, [])
        if engine_id in taken:
            taken.remove(engine_id)
            self._in_engine.discard(engine_id)
        if not taken:
            self._engine_ids.pop(request_id, None)

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream ``RequestOutput`` objects for one request (same contract as ``AsyncLLM.generate``),
        carried over engine faults.

        Raises:
            EngineUnavailableError: no engine became READY in time (503), or the request could not be
                carried over a death (not resumable, replay limit).
            QuarantinedRequestError: the request is quarantined (400).
        """
        _mark_entered()
        fp = Fingerprint(prompt, sampling_params)  # computed only when read (a fault, a strike, a log line)
        self._check_quarantine(fp)
        engine_id = self._claim(request_id)  # the request's id inside the engine
        renamed, carries = engine_id != request_id, 0
        try:
            carry = Carry.start(prompt, sampling_params)
            route, body = current_request.get() or (None, None)
            evidence = Evidence(route, body, prompt, sampling_params, current_client.get())
            # The request's outputs over as many attempts as it takes (one async generator between the
            # serving layer and the engine's: every output passes each generator once).
            while True:
                async with contextlib.aclosing(self._attempt(carry, fp, engine_id, evidence, kwargs)) as outputs:
                    async for output in outputs:
                        if renamed:  # the serving layer's own id, as it asked
                            output.request_id = request_id
                        yield output
                if carry.outcome is Outcome.DONE:
                    return
                if carry.outcome is not Outcome.CARRY:
                    continue
                # The engine died under this request, or cut it in a soft recovery: quarantine, then replay or
                # resume on the current engine.
                self._check_quarantine(fp)
                carries += 1
                self._carry_over(carry, carries, fp, engine_id)
        finally:
            self._release(request_id, engine_id)

    def _carry_over(self, carry: Carry, carries: int, fp: Fingerprint, request_id: str) -> None:
        """Count the ``carries``-th carry-over of ``request_id`` (its engine-side id), or refuse it.

        Raises:
            EngineUnavailableError: more carry-overs than ``max_replays``.
            NotResumableError: output was handed on and the request cannot continue from it.
        """
        if carries > self._port.max_replays:
            m.REQUESTS_FAILED.labels(reason="replay_limit").inc()
            raise EngineUnavailableError("request outlived too many engine deaths", reason="replay_limit")
        if carry.yielded and not (carry.delta and carry.single and carry.sent):
            m.REQUESTS_FAILED.labels(reason="not_resumable").inc()
            raise NotResumableError("engine restarted after output was sent; this request cannot be resumed")
        (m.REQUESTS_RESUMED if carry.sent else m.REQUESTS_REPLAYED).inc()
        logger.warning("request %s (%s) carried over: %s", request_id, fp, carry.how())

    async def _attempt(
        self, carry: Carry, fp: Fingerprint, request_id: str, evidence: Evidence, kwargs: dict[str, Any]
    ) -> AsyncGenerator[RequestOutput, None]:
        """One try of the request on the current engine: its outputs as they may be handed on; how it
        ended is left in ``carry.outcome``."""
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        port = self._port
        carry.outcome = Outcome.RETRY
        prompt, params, rerun = carry.inputs()  # raises NotResumableError before the request waits
        async with port.attempt(request_id, fp, evidence) as attempt:
            if attempt is None:
                return
            stripped = False  # images this engine core holds go as their hashes (last, after waits)
            # Not for n > 1: a stream's samples come apart, so a miss would not be seen as one.
            if not carry.whole and carry.single and attempt.ipc_cache is not None:
                prompt, stripped = attempt.ipc_cache.strip(prompt)
            cut = missed = False
            first = True
            try:
                async for output in attempt.engine.generate(prompt, params, request_id, **kwargs):
                    port.output(attempt)
                    # A soft recovery finished it (always its last output): deliver the tokens of earlier
                    # steps it may carry, not the finish; then carry the request over.
                    if not cut and _error_finish(output) and port.take_cut(attempt, request_id):
                        cut = True
                        _unfinish(output, getattr(params, "output_text_buffer_length", 0))
                    # The engine core did not hold an image sent as its hash: send it again, whole.
                    if first:
                        first = False
                        if not cut and cache_miss(output, stripped, True):
                            missed = True
                            continue
                    if rerun is not None and (output := rerun.take(output, cut)) is None:
                        continue  # the re-run is still inside what was sent
                    if cut:
                        if not (carry.delta and carry.single and output.outputs and output.outputs[0].token_ids):
                            continue
                    else:
                        port.delivered(attempt)
                    carry.deliver(output)
                    yield output
            except EngineDeadError:
                port.died(attempt)
                carry.outcome = Outcome.CARRY
                return
            except EngineGenerateError as exc:  # before any output: refused for the request's own content?
                if first and (mine := UnsendableRequestError.of(exc.__cause__)) is not None:
                    raise mine from exc
                raise
            except NotResumableError:  # a re-run that diverged: it ends here, on the engine too
                await attempt.engine.abort(request_id)
                raise
            except Exception as exc:
                if (fault := output_fault(exc)) is None:
                    raise
                port.output_fault(attempt, request_id, fault)
                carry.outcome = Outcome.CARRY
                return
            if missed:
                carry.whole, carry.outcome = True, Outcome.RESEND
                m.MM_CACHE_RESENDS.inc()
                logger.warning("request %s: the engine core missed a cached image; sent again whole", request_id)
            elif cut:
                carry.outcome = Outcome.CARRY
            else:
                port.completed(attempt, fp)
                carry.outcome = Outcome.DONE

    def _check_quarantine(self, fp: Fingerprint) -> None:
        try:
            self._port.check_quarantine(fp)
        except QuarantinedRequestError:
            m.REQUESTS_QUARANTINED.inc()
            logger.warning("refused quarantined request %s", fp)
            raise

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (by the serving layer's ids: every request inside under each) in the current
        engine (no-op when no engine is READY)."""
        asked = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = [engine_id for rid in asked for engine_id in self._engine_ids.get(rid, [rid])]
        if (engine := self._port.current_engine()) is not None:
            await engine.abort(ids)

    @property
    def errored(self) -> bool:
        """True only when the supervisor gave up: a dead engine is being replaced, not an error."""
        return self._port.state is EngineState.FAILED

    @property
    def dead_error(self) -> BaseException:
        return EngineUnavailableError("engine failed and could not be restarted", reason="engine_failed")

    @property
    def is_running(self) -> bool:
        return self._port.state is EngineState.READY

    @property
    def is_stopped(self) -> bool:
        return self._port.state in (EngineState.STOPPED, EngineState.FAILED)

    async def do_log_stats(self) -> None:
        """The current engine's stats logged (vLLM's app logs them every ``VLLM_LOG_STATS_INTERVAL`` s);
        nothing while there is none, never an exception (it would end vLLM's logging task for good)."""
        with contextlib.suppress(Exception):
            await self._port.latest_engine.do_log_stats()

    def __getattr__(self, name: str) -> Any:
        # Everything else (model_config, renderer, input_processor, vllm_config, get_supported_tasks,
        # check_health, do_log_stats, ...) is the engine's own: the latest one built, so that the serving
        # layer's reads of static attributes keep working while a dead engine is being replaced.
        return getattr(self._port.latest_engine, name)
