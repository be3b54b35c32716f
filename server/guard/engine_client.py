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

import logging
from collections.abc import AsyncGenerator, Iterable
from typing import TYPE_CHECKING, Any

from server.guard.clients import current_client
from server.guard.errors import EngineUnavailableError, NotResumableError, QuarantinedRequestError
from server.guard.ipc_cache import cache_miss
from server.guard.output_faults import output_fault
from server.guard.quarantine import fingerprint
from server.guard.rerun import Rerun, rerun_params, rerun_reason, seeded_for_rerun
from server.guard.supervisor import EngineState
from server.metrics import definitions as m

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

    from server.guard.supervisor import Supervisor

logger = logging.getLogger(__name__)


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
    return any(c.finish_reason == "error" for c in output.outputs)


def _unfinish(output: RequestOutput) -> None:
    """Make a cut request's last output an ordinary one: it may carry tokens of earlier steps (outputs not
    yet read are merged), which are delivered; the finish is not."""
    output.finished = False
    for completion in output.outputs:
        completion.finish_reason = None
        completion.stop_reason = None


class GuardedEngineClient:
    """Duck-typed ``vllm.engine.protocol.EngineClient`` over the supervisor's current engine.

    Arguments:
        supervisor: owns the engine, the quarantine and the in-flight registry.
    """

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream ``RequestOutput`` objects for one request (same contract as ``AsyncLLM.generate``).

        Raises:
            EngineUnavailableError: no engine became READY in time (503), or the request could not be
                carried over a death (not resumable, replay limit).
            QuarantinedRequestError: the request is quarantined (400).
        """
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        sup = self._supervisor
        client = current_client.get()
        fp = fingerprint(prompt, sampling_params)
        self._check_quarantine(fp)
        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        single = getattr(sampling_params, "n", 1) == 1
        # A stream with decoding state is re-run, not resumed, after sending tokens (a sampling one gets a
        # seed now, so its re-run draws the same tokens).
        stateful = delta and single and rerun_reason(sampling_params) is not None
        if stateful:
            sampling_params = seeded_for_rerun(sampling_params)
        original_prompt_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        sent: list[int] = []
        sent_text: list[str] = []
        yielded = False
        carries = 0
        whole = False  # send every processed image with its data (the engine core missed one)
        while True:
            try:
                engine, generation = await sup.acquire()
            except EngineUnavailableError as exc:
                m.REQUESTS_FAILED.labels(reason=exc.reason).inc()
                raise
            attempt_prompt, attempt_params = prompt, sampling_params
            rerun = None
            if sent and stateful:
                attempt_params, rerun = rerun_params(sampling_params), Rerun(sent, "".join(sent_text))
            elif sent:
                attempt_prompt, attempt_params = resume_input(prompt, sampling_params, sent)
            suspect = sup.is_suspect(fp)
            if not suspect:
                await sup.inflight.door()  # a suspect is isolated: wait until its first step passed
            async with sup.inflight.probation(suspect):
                if generation != sup.generation:  # the engine died while this request waited
                    continue
                if not sup.inflight:
                    sup.note_progress(output=False)  # idle -> busy: the hang clock starts now
                # The death is reported while this request is still on the ledger: it was in flight.
                with sup.inflight.entered(request_id, fp, generation, client):
                    stripped = False  # images this engine core holds go as their hashes (last, after waits)
                    # Not for n > 1: a stream's samples come apart, so a miss would not be seen as one.
                    if not whole and single and (shadow := sup.ipc_cache(generation)) is not None:
                        attempt_prompt, stripped = shadow.strip(attempt_prompt)
                    try:
                        cut = missed = False
                        first = True
                        async for output in engine.generate(attempt_prompt, attempt_params, request_id, **kwargs):
                            sup.note_progress()
                            # A soft recovery finished it (always its last output): deliver the tokens of
                            # earlier steps it may carry, not the finish; then carry the request over.
                            cut = cut or (_error_finish(output) and sup.take_cut(generation, request_id))
                            # The engine core did not hold an image sent as its hash: send it again, whole.
                            missed, first = not cut and cache_miss(output, stripped, first), False
                            if missed:
                                continue
                            if rerun is not None and (output := rerun.take(output, cut)) is None:
                                continue  # the re-run is still inside what was sent
                            if cut:
                                _unfinish(output)
                                if not (delta and single and output.outputs and output.outputs[0].token_ids):
                                    continue
                            elif suspect:
                                sup.inflight.suspect_progressed()
                            if sent and original_prompt_ids is not None:
                                output.prompt_token_ids = original_prompt_ids
                            if delta and single and output.outputs:
                                sent.extend(output.outputs[0].token_ids)
                                sent_text.append(output.outputs[0].text)
                            yielded = True
                            yield output
                        if missed:
                            whole = True
                            m.MM_CACHE_RESENDS.inc()
                            logger.warning(
                                "request %s: the engine core missed a cached image; sent again whole", request_id
                            )
                            continue
                        if not cut:
                            if suspect:
                                sup.cleared(fp)
                            return
                    except EngineDeadError:
                        sup.report_death(generation)
                    except NotResumableError:  # a re-run that diverged: it ends here, on the engine too
                        await engine.abort(request_id)
                        raise
                    except Exception as exc:
                        if (fault := output_fault(exc)) is None:
                            raise
                        sup.output_fault(generation, request_id, fault)
            # The engine died under this request, or cut it in a soft recovery: quarantine, then replay or
            # resume on the current engine.
            self._check_quarantine(fp)
            carries += 1
            if carries > sup.settings.max_replays:
                m.REQUESTS_FAILED.labels(reason="replay_limit").inc()
                raise EngineUnavailableError("request outlived too many engine deaths", reason="replay_limit")
            if yielded and not (delta and single and sent):
                m.REQUESTS_FAILED.labels(reason="not_resumable").inc()
                raise NotResumableError("engine restarted after output was sent; this request cannot be resumed")
            (m.REQUESTS_RESUMED if sent else m.REQUESTS_REPLAYED).inc()
            how = "replay" if not sent else f"{'re-run' if stateful else 'resume'} after {len(sent)} tokens"
            logger.warning("request %s (%s) carried over: %s", request_id, fp, how)

    def _check_quarantine(self, fp: str) -> None:
        try:
            self._supervisor.quarantine.check(fp)
        except QuarantinedRequestError:
            m.REQUESTS_QUARANTINED.inc()
            logger.warning("refused quarantined request %s", fp)
            raise

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests in the current engine (no-op when no engine is READY)."""
        if self._supervisor.state is EngineState.READY:
            await self._supervisor.engine.abort(request_id)

    @property
    def errored(self) -> bool:
        """True only when the supervisor gave up: a dead engine is being replaced, not an error."""
        return self._supervisor.state is EngineState.FAILED

    @property
    def dead_error(self) -> BaseException:
        return EngineUnavailableError("engine failed and could not be restarted", reason="engine_failed")

    @property
    def is_running(self) -> bool:
        return self._supervisor.state is EngineState.READY

    @property
    def is_stopped(self) -> bool:
        return self._supervisor.state in (EngineState.STOPPED, EngineState.FAILED)

    def __getattr__(self, name: str) -> Any:
        # Everything else (model_config, renderer, input_processor, vllm_config, get_supported_tasks,
        # check_health, do_log_stats, ...) is the engine's own: the latest one built, so that the serving
        # layer's reads of static attributes keep working while a dead engine is being replaced.
        return getattr(self._supervisor.latest_engine, name)
