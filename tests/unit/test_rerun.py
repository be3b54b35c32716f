"""Carrying a stream with decoding state over a recovery by re-running it (#35): which requests need it,
their seed, and the seam check that hands on only what follows the tokens already sent."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from server.guard.errors import NotResumableError
from server.guard.rerun import Rerun, rerun_params, rerun_reason, seeded_for_rerun


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (SamplingParams(temperature=0), None),
        (SamplingParams(temperature=0, repetition_penalty=1.3), None),  # prompt and output alike: carried
        (SamplingParams(temperature=0, logit_bias={5: 2.0}, min_tokens=3, stop_token_ids=[7], logprobs=2), None),
        (SamplingParams(temperature=1.0), None),  # unseeded sampling: any continuation is as likely
        (SamplingParams(temperature=0, seed=7), None),  # a seed does nothing for greedy decoding
        (SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(regex="(ab){20}c")), "structured"),
        (SamplingParams(temperature=0, frequency_penalty=1.5), "penalty"),
        (SamplingParams(temperature=0, presence_penalty=-0.5), "penalty"),
        (SamplingParams(temperature=1.0, seed=7), "seeded"),
        (SamplingParams(temperature=0, stop=["\n\n"]), "stop strings"),
        (SamplingParams(temperature=0, extra_args={"x": 1}), "logits processors"),
    ],
)
def test_rerun_is_needed_exactly_for_state_that_resumption_loses(params: SamplingParams, reason: str | None) -> None:
    found = rerun_reason(params)
    assert (found is None) if reason is None else (found is not None and reason in found)


def test_unseeded_sampling_with_state_gets_a_seed_and_nothing_else_changes() -> None:
    params = SamplingParams(temperature=0.8, frequency_penalty=1.0)
    seeded = seeded_for_rerun(params)
    assert seeded is not params and isinstance(seeded.seed, int) and params.seed is None
    assert seeded_for_rerun(SamplingParams(temperature=0.8, frequency_penalty=1.0)).seed != seeded.seed
    for untouched in (SamplingParams(temperature=0.8), SamplingParams(temperature=0, frequency_penalty=1.0),
                      SamplingParams(temperature=0.8, seed=3, stop=["x"])):  # fmt: skip
        assert seeded_for_rerun(untouched) is untouched
    stream = SamplingParams(temperature=0, stop=["x"], output_kind=RequestOutputKind.DELTA)
    assert rerun_params(stream).output_kind == RequestOutputKind.CUMULATIVE
    assert stream.output_kind == RequestOutputKind.DELTA  # the original is untouched


def _cumulative(ids: list[int], finished: bool = False, logprobs: bool = False) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text="".join(f" t{t}" for t in ids),
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=[{t: float(-i)} for i, t in enumerate(ids)] if logprobs else None,  # type: ignore[misc]
        finish_reason="length" if finished else None,
    )
    return RequestOutput("r", None, [1, 2], None, [completion], finished)


def test_the_rerun_hands_on_only_what_follows_the_seam() -> None:
    rerun = Rerun([10, 11, 12], " t10 t11 t12")
    assert rerun.take(_cumulative([10])) is None  # inside what was sent
    assert rerun.take(_cumulative([10, 11, 12])) is None
    out = rerun.take(_cumulative([10, 11, 12, 13, 14], logprobs=True))  # one output across the seam
    assert out is not None
    [completion] = out.outputs
    assert (completion.token_ids, completion.text) == ([13, 14], " t13 t14")
    assert completion.logprobs == [{13: -3.0}, {14: -4.0}]
    last = rerun.take(_cumulative([10, 11, 12, 13, 14, 15], finished=True))
    assert last is not None and last.finished and last.outputs[0].token_ids == [15]


@pytest.mark.parametrize(
    ("output", "why"),
    [
        (_cumulative([10, 99]), "token 1 is 99 on the re-run, 11 was sent"),
        (_cumulative([10, 11, 12, 13, 99, 98]), "token 4"),  # a difference past what the first output showed
        (_cumulative([10, 11], finished=True), "finished after 2 of the 5 tokens"),
    ],
)
def test_a_rerun_that_differs_from_what_was_sent_ends_the_stream(output: RequestOutput, why: str) -> None:
    rerun = Rerun([10, 11, 12, 13, 14], " t10 t11 t12 t13 t14")
    with pytest.raises(NotResumableError, match=why):
        rerun.take(output)


def test_text_that_differs_ends_the_stream_and_a_cut_rerun_is_carried_again() -> None:
    with pytest.raises(NotResumableError, match="text"):
        Rerun([10, 11], " t10 X11").take(_cumulative([10, 11, 12]))
    rerun = Rerun([10, 11, 12], " t10 t11 t12")
    assert rerun.take(_cumulative([10], finished=True), cut=True) is None  # a soft recovery cut the re-run
