"""Poison quarantine: K deaths, bounded size, bounded time."""

from __future__ import annotations

import pytest

from server.guard.quarantine import Quarantine, QuarantinedRequestError, fingerprint


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_quarantined_after_k_deaths_only() -> None:
    q = Quarantine(deaths=2, max_entries=10, ttl_s=100)
    assert q.record_death(["a", "b"]) == []
    q.check("a")
    assert q.record_death(["a"]) == ["a"]
    with pytest.raises(QuarantinedRequestError, match="fingerprint a"):
        q.check("a")
    q.check("b")


def test_forgotten_after_ttl() -> None:
    clock = Clock()
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


def test_fingerprint_depends_on_prompt_images_and_params() -> None:
    base = fingerprint({"prompt_token_ids": [1, 2, 3], "mm_hashes": {"image": ["h1"]}}, "params-a")
    assert base == fingerprint({"prompt_token_ids": [1, 2, 3], "mm_hashes": {"image": ["h1"]}}, "params-a")
    assert base != fingerprint({"prompt_token_ids": [1, 2, 4], "mm_hashes": {"image": ["h1"]}}, "params-a")
    assert base != fingerprint({"prompt_token_ids": [1, 2, 3], "mm_hashes": {"image": ["h2"]}}, "params-a")
    assert base != fingerprint({"prompt_token_ids": [1, 2, 3], "mm_hashes": {"image": ["h1"]}}, "params-b")
    assert len(base) == 16
