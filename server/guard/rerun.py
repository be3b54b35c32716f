"""Carrying a stream with per-request decoding state over a recovery: re-run it and check the seam (#35).

A stream that already sent tokens is normally **resumed**: the new engine gets the prompt plus the sent
tokens as its prompt (:func:`server.guard.engine_client.resume_input`). That is exact only for requests
whose decoding has no state beyond the token sequence: the new engine starts every per-request state
from zero. :func:`rerun_reason` names the state that resumption would lose:

* a structured-output constraint (``structured_outputs``, ``response_format``): the grammar would restart
  at the seam (a ``(ab){20}c`` regex stream ended ``ababaabab...c``; JSON that did not parse);
* frequency and presence penalties: the sent tokens would count as prompt, not output (the repetition
  penalty counts prompt and output alike, so it is carried by resumption);
* a seed with sampling: the seeded generator would start again;
* stop strings (one spanning the seam would be missed), bad words (checked against the output so far),
  custom logits processors or ``extra_args`` (their state is unknown).

Such a stream is **re-run** instead: the new engine runs the original request from its start, with its
original parameters, so every piece of state is rebuilt by the engine itself on any vLLM version (no
engine internals touched). :class:`Rerun` checks that the re-run produces exactly the token ids and text
already sent, hands on only what follows them, and ends the stream with an error if they differ (never
a silently different answer). Greedy and seeded requests re-run identically; an unseeded sampling
request with such state gets a random seed at admission (:func:`seeded_for_rerun`: as random for the
client as no seed), so it can be re-run too. The cost: the re-run recomputes the sent tokens before the
stream goes on (one decode step each).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from server.guard.errors import NotResumableError
from server.metrics import definitions as m

#: How a stream carried over a recovery after sending tokens continues, by what its request asks
#: (``/version`` reports it). The same on every vLLM version: a re-run lets the engine rebuild its state.
CARRY_OVER = {
    "resumed": [
        "greedy",
        "unseeded sampling",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "stop_token_ids",
        "allowed_token_ids",
        "logprobs",
    ],
    "rerun": [
        "structured outputs",
        "response_format",
        "frequency_penalty",
        "presence_penalty",
        "seeded sampling",
        "stop strings",
        "bad_words",
        "logits processors",
    ],
    "error_event": ["n > 1", "cumulative streams", "a re-run whose tokens differ from those sent"],
}

#: Below this temperature vLLM samples greedily (``vllm.sampling_params._SAMPLING_EPS``).
_GREEDY_BELOW = 1e-5


def rerun_reason(params: Any) -> str | None:
    """What per-request decoding state of ``params`` (a ``SamplingParams``) a resumption from prompt plus
    sent tokens would lose, or None when resumption is exact (read by attribute, so a field a vLLM
    version lacks is simply absent)."""
    if getattr(params, "structured_outputs", None) is not None:
        return "structured outputs"
    if getattr(params, "frequency_penalty", 0) or getattr(params, "presence_penalty", 0):
        return "frequency or presence penalty"
    if getattr(params, "seed", None) is not None and not _greedy(params):
        return "seeded sampling"
    if getattr(params, "stop", None):
        return "stop strings"
    if getattr(params, "bad_words", None):
        return "bad words"
    if getattr(params, "logits_processors", None) or getattr(params, "extra_args", None):
        return "logits processors"
    return None


def _greedy(params: Any) -> bool:
    return float(getattr(params, "temperature", 1.0)) < _GREEDY_BELOW


def seeded_for_rerun(params: Any) -> Any:
    """``params``, with a random seed when it samples without one and has state a re-run must rebuild
    (:func:`rerun_reason`), so that a re-run draws the same tokens; else ``params`` itself."""
    if _greedy(params) or getattr(params, "seed", None) is not None or rerun_reason(params) is None:
        return params
    seeded = params.clone()
    seeded.seed = secrets.randbits(63)
    return seeded


def rerun_params(params: Any) -> Any:
    """``params`` for the re-run: cumulative outputs (each holds every token and all the text so far),
    so the seam can be checked and cut at a token boundary whatever the engine merged into one output."""
    from vllm.sampling_params import RequestOutputKind

    rerun = params.clone()
    rerun.output_kind = RequestOutputKind.CUMULATIVE
    return rerun


class Rerun:
    """The seam of one re-run: ``sent`` token ids and ``sent_text`` were delivered before the recovery.

    :meth:`take` turns the re-run's cumulative outputs into the delta outputs the client's stream expects,
    beginning right after the seam.
    """

    def __init__(self, sent: list[int], sent_text: str) -> None:
        self.sent = list(sent)
        self.sent_text = sent_text
        self.tokens = len(sent)  # tokens of the re-run handed on so far (the sent ones count as handed on)
        self.chars = len(sent_text)

    def take(self, output: Any, cut: bool = False) -> Any | None:
        """The part of the re-run's cumulative ``output`` (a ``RequestOutput``, ``n == 1``) past what was
        handed on, as a delta output (modified in place), or None when there is nothing new yet.

        Arguments:
            cut: the output is the last of a re-run that a soft recovery cut (it may end short).

        Raises:
            NotResumableError: the re-run's tokens or text differ from what was sent, or it finished
                before reaching the seam.
        """
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        text = completion.text
        seen = min(len(ids), len(self.sent))
        if ids[:seen] != self.sent[:seen]:
            at = next(i for i in range(seen) if ids[i] != self.sent[i])
            self._diverged(f"token {at} is {ids[at]} on the re-run, {self.sent[at]} was sent")
        if len(ids) < len(self.sent):
            if not self.sent_text.startswith(text):
                self._diverged("the re-run's text differs from the text sent")
            if output.finished and not cut:
                self._diverged(f"the re-run finished after {len(ids)} of the {len(self.sent)} tokens sent")
            return None
        if not text.startswith(self.sent_text):
            self._diverged("the re-run's text differs from the text sent")
        new_ids, new_text = ids[self.tokens :], text[self.chars :]
        if not new_ids and not output.finished:
            return None
        logprobs = completion.logprobs[self.tokens :] if completion.logprobs is not None else None
        output.outputs[0] = dataclasses.replace(completion, token_ids=new_ids, text=new_text, logprobs=logprobs)
        output.prompt_logprobs = None  # sent with the stream's first output, before the recovery
        self.tokens, self.chars = len(ids), len(text)
        return output

    @staticmethod
    def _diverged(why: str) -> None:
        m.REQUESTS_FAILED.labels(reason="rerun_diverged").inc()
        raise NotResumableError(f"engine restarted mid-stream and the re-run of this request diverged: {why}")
