"""Resuming a stream on a new engine: the prompt grows by the tokens sent, max_tokens shrinks by as many."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from server.guard.engine_client import resume_input
from server.guard.errors import NotResumableError


def test_resume_appends_sent_tokens_and_lowers_budgets() -> None:
    prompt = {"type": "multimodal", "prompt_token_ids": [1, 2, 3], "mm_hashes": {"image": ["h"]}}
    params = SamplingParams(max_tokens=10, min_tokens=4, temperature=0)
    resumed, new_params = resume_input(prompt, params, [7, 8, 9])
    assert resumed["prompt_token_ids"] == [1, 2, 3, 7, 8, 9]
    assert resumed["mm_hashes"] == {"image": ["h"]}  # image placeholders and hashes stay as they were
    assert prompt["prompt_token_ids"] == [1, 2, 3]  # the original is untouched (a later resume starts from it)
    assert (new_params.max_tokens, new_params.min_tokens) == (7, 1)
    assert (params.max_tokens, params.min_tokens) == (10, 4)


def test_prompt_without_token_ids_cannot_be_resumed() -> None:
    with pytest.raises(NotResumableError):
        resume_input("plain text prompt", SamplingParams(max_tokens=5), [1])
