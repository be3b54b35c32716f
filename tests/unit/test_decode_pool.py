"""The decode pool: at most so many jobs at once, a pixel budget served in arrival order, pixels given
back only when a job really ends (raised included). Jobs run on the caller's thread (vLLM's media
loading threads), which blocks until the pool takes the job."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from server.api.decode_pool import DecodePool

WAIT_S = 5


class _Job:
    """A decode that blocks its thread until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, name: str) -> str:
        self.started.set()
        assert self.release.wait(WAIT_S)
        return name


def _waiting(pool: DecodePool, n: int) -> None:
    """Wait until ``n`` jobs wait in ``pool`` (what the pool reports, not a sleep)."""
    with pool._changed:
        assert pool._changed.wait_for(lambda: len(pool._queue) == n, WAIT_S)


def test_the_budget_bounds_the_pixels_decoding_at_once_in_arrival_order() -> None:
    pool = DecodePool(threads=4, max_pixels=100)
    big, second, third = _Job(), _Job(), _Job()
    with ThreadPoolExecutor(3) as threads:
        first = threads.submit(pool.run, 60, big, "big")
        assert big.started.wait(WAIT_S)
        blocked = threads.submit(pool.run, 60, second, "second")  # 60 + 60 > 100: waits
        _waiting(pool, 1)
        behind = threads.submit(pool.run, 10, third, "third")  # fits, but arrived after: waits too
        _waiting(pool, 2)
        assert pool.free == 40 and not second.started.is_set() and not third.started.is_set()
        big.release.set()
        assert first.result(WAIT_S) == "big"
        assert second.started.wait(WAIT_S) and third.started.wait(WAIT_S)
        second.release.set()
        third.release.set()
        assert [blocked.result(WAIT_S), behind.result(WAIT_S)] == ["second", "third"]
    assert pool.free == 100 and pool.running == 0


def test_at_most_threads_jobs_run_at_once() -> None:
    pool = DecodePool(threads=1, max_pixels=100)
    one, two = _Job(), _Job()
    with ThreadPoolExecutor(2) as threads:
        first = threads.submit(pool.run, 1, one, "one")
        assert one.started.wait(WAIT_S)
        second = threads.submit(pool.run, 1, two, "two")  # pixels enough, no slot
        _waiting(pool, 1)
        assert not two.started.is_set()
        one.release.set()
        two.release.set()
        assert (first.result(WAIT_S), second.result(WAIT_S)) == ("one", "two")


def test_a_job_larger_than_the_budget_runs_alone() -> None:
    pool = DecodePool(threads=2, max_pixels=100)
    job = _Job()
    job.release.set()
    assert pool.run(10_000, job, "huge") == "huge"
    assert pool.free == 100


def test_a_job_that_raises_gives_its_pixels_and_slot_back() -> None:
    pool = DecodePool(threads=1, max_pixels=100)

    def broken() -> None:
        raise OSError("truncated")

    with pytest.raises(OSError, match="truncated"):
        pool.run(100, broken)
    assert pool.free == 100 and pool.running == 0
    assert pool.run(100, lambda: "after") == "after"


def test_a_pool_needs_threads_and_pixels() -> None:
    with pytest.raises(ValueError, match="at least one"):
        DecodePool(threads=0, max_pixels=1)
