"""The hold timeout (server.guard.hold): measured from the builds, by the path the rebuild in progress takes;
the supervisor measuring its builds with its own clock; a held request whose limit grows while it waits."""

from __future__ import annotations

import asyncio

import pytest

from server.guard.errors import EngineUnavailableError
from server.guard.hold import HoldPolicy, RebuildPath
from server.guard.states import EngineState, EngineStates
from server.guard.watchdog import DeathCause
from tests.fakes import FakeEngineFactory, GuardHarness

WAIT_S = 10.0


def test_the_hold_follows_the_path_and_the_last_build_on_it() -> None:
    policy = HoldPolicy(None, startup_timeout_s=1800)
    assert policy.limit(None) == 1800  # first start: nothing measured, its own bound
    assert policy.limit(RebuildPath.COLD) == 1800  # a cold rebuild before anything was measured
    assert policy.limit(RebuildPath.SPARE) == 120  # the floor
    policy.measured(RebuildPath.COLD, 137.0)  # the first start, as measured on the 2-core machine
    assert policy.limit(RebuildPath.COLD) == policy.limit(RebuildPath.SPARE_STARTING) == 1.5 * 137 + 30
    assert policy.limit(RebuildPath.SPARE) == 120
    policy.measured(RebuildPath.SPARE, 100.0)
    assert policy.limit(RebuildPath.SPARE) == 150
    policy.measured(RebuildPath.COLD, 20.0)  # a fast cold rebuild: the floor still holds
    assert policy.limit(RebuildPath.COLD) == 120
    policy.measured(RebuildPath.COLD, 5000.0)  # never longer than a build may take
    assert policy.limit(RebuildPath.COLD) == 1800


def test_an_operators_bound_is_the_bound_whatever_was_measured() -> None:
    policy = HoldPolicy(45.0, startup_timeout_s=1800)
    policy.measured(RebuildPath.COLD, 600.0)
    assert {policy.limit(p) for p in (None, *RebuildPath)} == {45.0}
    assert policy.base_s == 45.0 and HoldPolicy(None, 1800).base_s == 120


async def test_the_supervisor_measures_each_build_with_its_clock() -> None:
    factory = FakeEngineFactory()
    g = GuardHarness(factory, hold_timeout=None, shutdown_timeout=0.5)
    factory.gate.clear()
    start = asyncio.create_task(g.sup.start())
    await asyncio.to_thread(factory.building.wait, WAIT_S)
    assert g.sup.hold_limit() == 1800  # first start: the start-up timeout
    g.clock.now += 200  # a slow first start
    factory.gate.set()
    await asyncio.wait_for(start, WAIT_S)
    try:
        assert g.sup.holds.last(RebuildPath.COLD) == 200
        factory.gate.clear()
        g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
        await g.state(EngineState.RESTARTING)
        assert g.sup.hold_limit() == 1.5 * 200 + 30  # no spare here: cold
        g.clock.now += 40
        factory.gate.set()
        await g.state(EngineState.READY)
        assert g.sup.holds.last(RebuildPath.COLD) == 40
        assert g.sup.hold_limit() == 120  # the next cold rebuild: 1.5 x 40 + 30 is under the floor
    finally:
        await g.sup.shutdown()


async def test_a_held_request_waits_while_its_limit_grows_and_is_refused_once_it_runs_out() -> None:
    states = EngineStates()
    states.set(EngineState.RESTARTING)
    limits = [0.05]  # the first read; then the rebuild turns out slower (its spare was refused)
    reads: list[float] = []

    def limit() -> float:
        reads.append(limits[0])
        return limits[0]

    held = asyncio.create_task(states.hold(limit, max_held=4))
    await asyncio.sleep(0)
    limits[0] = 30.0
    await asyncio.sleep(0.2)  # past the first limit: read again, still held
    assert not held.done() and reads[-1] == 30.0 and states.held == 1
    states.set(EngineState.READY)
    await asyncio.wait_for(held, WAIT_S)
    states.set(EngineState.RESTARTING)
    with pytest.raises(EngineUnavailableError, match=r"not ready within 0.05 s \(restarting\)"):
        await states.hold(lambda: 0.05, max_held=4)
    assert states.held == 0


def test_a_rebuild_is_bounded_by_the_last_cold_build_and_the_first_start_by_the_startup_timeout() -> None:
    policy = HoldPolicy(None, startup_timeout_s=1800)
    assert policy.build_limit(rebuild=False) == policy.build_limit(rebuild=True) == 1800  # nothing measured
    policy.measured(RebuildPath.COLD, 60.0)
    assert policy.build_limit(rebuild=True) == 300  # the floor
    policy.measured(RebuildPath.COLD, 200.0)
    assert policy.build_limit(rebuild=True) == 600 and policy.build_limit(rebuild=False) == 1800
    policy.measured(RebuildPath.COLD, 1000.0)
    assert policy.build_limit(rebuild=True) == 1800
    assert HoldPolicy(None, 1800, rebuild_s=20).build_limit(rebuild=True) == 20  # --guard-rebuild-timeout


async def test_a_stuck_rebuild_is_abandoned_at_its_bound_and_tried_again() -> None:
    factory = FakeEngineFactory()
    g = GuardHarness(factory, rebuild_timeout=0.2, shutdown_timeout=0.5)
    backed_off = asyncio.Event()

    async def sleep(seconds: float) -> None:
        g.slept.append(seconds)
        backed_off.set()

    g.sup._sleep = sleep
    await g.sup.start()
    try:
        factory.gate.clear()  # the rebuild never finishes: a stopped or hung engine process
        g.sup.report_death(g.sup.generation, DeathCause.PROCESS_EXIT)
        await g.state(EngineState.RESTARTING)
        await asyncio.wait_for(backed_off.wait(), WAIT_S)  # the attempt failed at its bound; the restart backs off
        factory.gate.set()
        await g.state(EngineState.READY)
        assert g.sup.generation == 2 and g.slept == [1.0] and g.failed_calls == 0
    finally:
        await g.sup.shutdown()
