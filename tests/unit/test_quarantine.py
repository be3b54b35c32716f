"""Poison quarantine: K deaths, bounded size, bounded time."""

from __future__ import annotations

import pytest

from server.guard.quarantine import Fingerprint, Quarantine, QuarantinedRequestError, fingerprint
from tests.helpers import ManualClock


def test_quarantined_after_k_deaths_only() -> None:
    q = Quarantine(deaths=2, max_entries=10, ttl_s=100)
    assert q.record_death(["a", "b"]) == []
    q.check("a")
    assert q.record_death(["a"]) == ["a"]
    with pytest.raises(QuarantinedRequestError, match="fingerprint a"):
        q.check("a")
    q.check("b")


def test_forgotten_after_ttl() -> None:
    clock = ManualClock(0.0)
    q = Quarantine(deaths=1, max_entries=10, ttl_s=60, clock=clock)
    q.record_death(["a"])
    assert q.is_quarantined("a")
    clock.now = 61
    assert not q.is_quarantined("a")


def test_bounded_in_size() -> None:
    q = Quarantine(deaths=1, max_entries=3, ttl_s=100)
    q.record_death(["a"])
    q.record_death(["b", "c", "d"])
    assert not q.is_quarantined("a")  # least recently seen went first
    assert all(q.is_quarantined(x) for x in "bcd")


def test_fingerprint_depends_on_prompt_images_and_constraint_not_on_volatile_sampling() -> None:
    """#34: the same poison with a new seed (or temperature, max_tokens, n) is the same fingerprint; a new
    prompt, image, constraint or token-id list is another."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompt = {"prompt_token_ids": [1, 2, 3], "mm_hashes": {"image": ["h1"]}}
    base = fingerprint(prompt, SamplingParams(seed=1, temperature=0.7, max_tokens=8))
    assert base == fingerprint(dict(prompt), SamplingParams(seed=2, temperature=1.3, top_p=0.5, max_tokens=64, n=2))
    assert base != fingerprint({**prompt, "prompt_token_ids": [1, 2, 4]}, SamplingParams(seed=1))
    assert base != fingerprint({**prompt, "mm_hashes": {"image": ["h2"]}}, SamplingParams(seed=1))
    assert base != fingerprint(prompt, SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    assert base != fingerprint(prompt, SamplingParams(stop_token_ids=[7], min_tokens=2))
    assert base != fingerprint(prompt, SamplingParams(logit_bias={5: 1.0}))
    assert len(base) == 16


def test_a_lazy_fingerprint_is_the_fingerprint_and_lets_the_prompt_go_once_read() -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompt = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"), skip_clone=True)
    at_entry = fingerprint(prompt, params)  # what the next such request is checked under
    lazy = Fingerprint(prompt, params)
    # Code review: vLLM validates the serving layer's own object (skip_clone), which sets the structured
    # outputs' backend; a fingerprint of the parameters read after that was another fingerprint.
    assert params.structured_outputs is not None
    params.structured_outputs._backend, params.structured_outputs._backend_was_auto = "xgrammar", True
    assert fingerprint(prompt, params) != at_entry  # the test can tell the two apart
    assert lazy.value == str(lazy) == at_entry
    assert lazy._prompt is None
    q = Quarantine(deaths=1, max_entries=10, ttl_s=100)
    assert q.empty()
    q.record_death([lazy.value])
    assert not q.empty()
