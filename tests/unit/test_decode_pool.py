"""The decode pool: its own threads, a pixel budget served in arrival order, pixels given back
only when a decode really ends (cancelled callers included)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.api.decode_pool import DecodePool

WAIT_S = 5


class _Job:
    """A decode that blocks its thread until released, recording how many run at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, name: str, log: list[str]) -> str:
        self.started.set()
        assert self.release.wait(WAIT_S)
        assert threading.current_thread().name.startswith("vlguard-decode")  # the pool's own threads
        log.append(name)
        return name


async def _started(job: _Job) -> None:
    assert await asyncio.to_thread(job.started.wait, WAIT_S)


async def test_the_budget_bounds_the_pixels_decoding_at_once_in_arrival_order() -> None:
    pool = DecodePool(threads=4, max_pixels=100)
    log: list[str] = []
    big, small, later = _Job(), _Job(), _Job()
    first = asyncio.create_task(pool.run(60, big, "big", log))
    await _started(big)
    blocked = asyncio.create_task(pool.run(60, small, "second", log))  # 60 + 60 > 100: waits
    behind = asyncio.create_task(pool.run(10, later, "third", log))  # fits, but arrived after: waits too
    await asyncio.sleep(0)
    assert pool.free == 40 and not small.started.is_set() and not later.started.is_set()
    big.release.set()
    assert await first == "big"
    await _started(small)
    await _started(later)
    small.release.set()
    later.release.set()
    assert await asyncio.gather(blocked, behind) == ["second", "third"]
    assert pool.free == 100
    pool.shutdown()


async def test_clients_take_turns_so_one_clients_queue_delays_another_by_one_job() -> None:
    """Hostile review: first come, first served, one client's twelve 7000x7000 images held another's small
    image for 27.6 s. In turns, the small image runs after one more of the first client's jobs, not all."""
    pool = DecodePool(threads=4, max_pixels=100)
    log: list[str] = []
    jobs = {name: _Job() for name in ("a1", "a2", "a3", "b1")}
    tasks = {"a1": asyncio.create_task(pool.run(100, jobs["a1"], "a1", log, client="a"))}
    await _started(jobs["a1"])
    for name in ("a2", "a3"):
        tasks[name] = asyncio.create_task(pool.run(100, jobs[name], name, log, client="a"))
    await asyncio.sleep(0)
    tasks["b1"] = asyncio.create_task(pool.run(10, jobs["b1"], "b1", log, client="b"))  # arrives last
    await asyncio.sleep(0)
    assert pool.waiting() == 3
    jobs["a1"].release.set()  # a's turn first (it was waiting first): a2 takes the budget
    await _started(jobs["a2"])
    assert not jobs["b1"].started.is_set() and not jobs["a3"].started.is_set()
    jobs["a2"].release.set()  # then b's turn, before a3
    await _started(jobs["b1"])
    assert not jobs["a3"].started.is_set()
    jobs["b1"].release.set()
    jobs["a3"].release.set()
    assert await asyncio.gather(*tasks.values()) == ["a1", "a2", "a3", "b1"]
    assert log == ["a1", "a2", "b1", "a3"] and pool.free == 100 and pool.waiting() == 0
    pool.shutdown()


async def test_a_job_larger_than_the_budget_runs_alone() -> None:
    pool = DecodePool(threads=2, max_pixels=100)
    job = _Job()
    job.release.set()
    assert await pool.run(10_000, job, "huge", []) == "huge"
    assert pool.free == 100
    pool.shutdown()


async def test_a_cancelled_caller_gives_its_place_up_or_its_pixels_back_when_the_decode_ends() -> None:
    pool = DecodePool(threads=2, max_pixels=100)
    running, waiting, after = _Job(), _Job(), _Job()
    first = asyncio.create_task(pool.run(100, running, "running", []))
    await _started(running)
    second = asyncio.create_task(pool.run(100, waiting, "waiting", []))
    await asyncio.sleep(0)
    second.cancel()  # gave up while waiting: never runs
    with pytest.raises(asyncio.CancelledError):
        await second
    first.cancel()  # gave up while decoding: the thread goes on, and so does its budget
    with pytest.raises(asyncio.CancelledError):
        await first
    assert pool.free == 0
    third = asyncio.create_task(pool.run(100, after, "after", []))
    await asyncio.sleep(0)
    assert not after.started.is_set()
    running.release.set()  # the first decode ends: its pixels come back, the third runs
    after.release.set()
    assert await asyncio.wait_for(third, WAIT_S) == "after"
    assert not waiting.started.is_set() and pool.free == 100
    pool.shutdown()


async def test_a_request_cancelled_with_several_images_waiting_leaves_the_pool_as_it_was() -> None:
    """Code review: vLLM gathers a request's images, so a disconnect cancels their waits together; a grant
    between the cancellations and their handlers granted a dead waiter (``InvalidStateError``), kept its
    pixels and jammed every later turn."""
    pool = DecodePool(threads=1, max_pixels=100)
    running = _Job()
    first = asyncio.create_task(pool.run(50, running, "running", [], client="a"))
    await _started(running)
    request = asyncio.gather(pool.run(60, lambda: 1, client="b"), pool.run(30, lambda: 2, client="b"))
    await asyncio.sleep(0)
    assert pool.waiting() == 2
    request.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await request
    running.release.set()
    assert await first == "running"
    assert await asyncio.wait_for(pool.run(10, lambda: "later", client="c"), WAIT_S) == "later"
    assert pool.free == 100 and pool.waiting() == 0 and not pool._turns
    pool.shutdown()


def test_a_pool_needs_threads_and_pixels() -> None:
    with pytest.raises(ValueError, match="at least one"):
        DecodePool(threads=0, max_pixels=1)
