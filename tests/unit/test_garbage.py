"""The count of finished body bytes between full collections (:mod:`server.api.garbage`)."""

from __future__ import annotations

import pytest

from server.api.garbage import FinishedBodies


def test_a_collection_runs_each_time_finished_bodies_reach_the_bound_and_the_count_starts_again() -> None:
    runs: list[int] = []
    bodies = FinishedBodies(100, collect=lambda: runs.append(1) or 0)
    assert [bodies.finished(n) for n in (40, 59, 1, 99, 0, 250, 10)] == [False, False, True, False, False, True, False]
    assert len(runs) == 2 and bodies.pending == 10


def test_the_bound_is_a_quarter_of_the_body_budget_and_must_be_positive() -> None:
    assert FinishedBodies.for_budget(64 * 1024 * 1024).bound == 16 * 1024 * 1024
    assert FinishedBodies.for_budget(1).bound == 1
    with pytest.raises(ValueError, match="positive"):
        FinishedBodies(0)
