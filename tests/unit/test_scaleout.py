"""The parts of ``--api-server-count N`` that need no engine: per-server guard state shared between API processes
(server/guard/peers.py), the owner link and the engine factory's waiting (server/scaleout), and the systemd relay."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from server.guard.clients import ClientBudget
from server.guard.peers import Change
from server.guard.quarantine import Quarantine
from server.scaleout.control import EngineDown, EngineUp
from server.scaleout.link import OwnerLink
from server.scaleout.owner import NotifyRelay


class Recorder:
    def __init__(self) -> None:
        self.changes: list[Change] = []

    def publish(self, change: Change) -> None:
        self.changes.append(change)


def test_a_quarantine_publishes_its_changes_and_takes_in_its_peers_at_the_next_read() -> None:
    mine, theirs = Quarantine(deaths=1, max_entries=10, ttl_s=60), Quarantine(deaths=1, max_entries=10, ttl_s=60)
    mine.peers = peers = Recorder()
    assert mine.record_death(["b", "a", "a"]) == ["a", "b"]
    assert peers.changes == [Change("strikes", ("a", "b"), peers.changes[0].at)]
    for change in peers.changes:  # what the owner forwards
        theirs.received.add(change)
    assert not theirs.empty() and theirs.is_quarantined("a") and theirs.is_quarantined("b")
    mine.clear("a")
    assert peers.changes[-1] == Change("cleared", ("a",), peers.changes[-1].at)
    theirs.received.add(peers.changes[-1])
    assert not theirs.is_quarantined("a") and theirs.is_quarantined("b")
    mine.clear()
    theirs.received.add(peers.changes[-1])
    assert theirs.empty()
    assert len(peers.changes) == 3  # taking a peer's change in publishes nothing


def test_a_client_budget_spent_through_one_process_is_spent_in_the_other() -> None:
    mine, theirs = ClientBudget(2, 60, 30), ClientBudget(2, 60, 30)
    mine.peers = peers = Recorder()
    mine.charge(["key:a", ""])  # "" is nobody: not published, not counted
    assert peers.changes == [Change("client_faults", ("key:a",), peers.changes[0].at)]
    mine.charge(["key:a"])
    for change in peers.changes:
        theirs.received.add(change)
    assert mine.refused_for("key:a") > 0 and theirs.refused_for("key:a") > 0
    assert theirs.refused_count() == 1


def test_changes_received_on_another_thread_are_taken_in_once() -> None:
    quarantine = Quarantine(deaths=2, max_entries=1000, ttl_s=60)
    adders = [threading.Thread(target=lambda: [quarantine.received.add(Change("strikes", (f"fp{i}",), time.monotonic()))
                                               for i in range(500)]) for _ in range(2)]  # fmt: skip
    for adder in adders:
        adder.start()
    for adder in adders:
        adder.join()
    assert sum(quarantine.is_quarantined(f"fp{i}") for i in range(500)) == 500  # two strikes each, no more
    assert all(quarantine.strikes(f"fp{i}") == 2 for i in range(500))


def _link() -> tuple[OwnerLink, Any]:
    owner_end, api_end = multiprocessing.Pipe()
    return OwnerLink(api_end), owner_end


def test_the_link_hands_each_message_to_its_handler_and_says_when_the_owner_is_gone() -> None:
    link, owner = _link()
    got: list[object] = []
    gone = threading.Event()
    link.on(EngineDown, got.append)
    link.on(EngineUp, lambda _: 1 / 0)  # a failing handler costs its message only
    link.on_gone(gone.set)
    link.start()
    owner.send(EngineUp(1, "/d", (1,)))
    owner.send("unexpected")
    owner.send(EngineDown(1))
    owner.close()
    assert gone.wait(5)
    assert got == [EngineDown(1)]


def _engines(link: OwnerLink, wait_s: float) -> Any:
    from server.scaleout.remote import RemoteEngines

    class Args:
        _api_process_count = _api_process_rank = 0

    return RemoteEngines(link, Args(), index=1, count=2, wait_s=wait_s)  # type: ignore[arg-type]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _taken(predicate: Any) -> None:
    """Wait until the link's thread has handled what was sent (``predicate()`` true)."""
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _next(engines: Any, wait_s: float) -> EngineUp:
    engines.wait_s = wait_s
    started = time.monotonic()
    try:
        up: EngineUp = engines._next(engines._ticket)
        return up
    finally:
        assert time.monotonic() - started < wait_s + 1


def test_a_build_takes_the_announced_engine_while_it_lives_and_was_not_announced_dead() -> None:
    link, owner = _link()
    engines = _engines(link, wait_s=5)
    link.start()
    alive, dead = os.getpid(), _dead_pid()
    owner.send(EngineUp(1, "/d1", (alive,)))
    assert _next(engines, 5).generation == 1
    assert _next(engines, 5).generation == 1  # a build that failed its probe connects to the same engine again
    owner.send(EngineDown(1))
    _taken(lambda: 1 in engines._down)
    with pytest.raises(TimeoutError):  # announced dead: nothing to build on
        _next(engines, 0.3)
    threading.Timer(0.2, lambda: owner.send(EngineUp(2, "/d2", (alive,)))).start()
    assert _next(engines, 5).generation == 2
    owner.send(EngineUp(3, "/d3", (dead,)))  # its engine core is gone, not yet announced (this process saw it)
    _taken(lambda: engines._announced.generation == 3)
    with pytest.raises(TimeoutError):
        _next(engines, 0.8)
    owner.send(EngineDown(4))  # a death announced before its engine: that engine is never built
    owner.send(EngineUp(4, "/d4", (alive,)))
    _taken(lambda: engines._announced.generation == 4)
    with pytest.raises(TimeoutError):
        _next(engines, 0.3)
    owner.close()
    with pytest.raises(RuntimeError, match="owner"):  # gone: a waiting build gives up at once
        _next(engines, 5)


def test_an_abandoned_build_gives_up_when_a_newer_one_starts() -> None:
    link, owner = _link()
    engines = _engines(link, wait_s=30)
    link.start()
    old = engines._ticket
    outcome: list[BaseException] = []

    def abandoned() -> None:
        try:
            engines._next(old)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=abandoned)
    waiter.start()
    with engines._changed:  # what a new build's call does first
        engines._ticket += 1
        engines._changed.notify_all()
    waiter.join(5)
    assert len(outcome) == 1 and "newer" in str(outcome[0])
    owner.send(EngineUp(1, "/d1", (os.getpid(),)))
    assert _next(engines, 5).generation == 1  # the newer build takes the engine
    owner.close()


def test_systemd_hears_ready_once_all_api_processes_are_and_watchdog_while_all_ping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    systemd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    systemd.bind(str(tmp_path / "notify"))
    systemd.settimeout(0.2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # pings due every second
    relay = NotifyRelay(2, str(tmp_path))
    senders = []
    for index in range(2):
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.connect(relay.environ(index)["NOTIFY_SOCKET"])
        senders.append(sender)

    def heard() -> list[str]:
        messages = []
        while True:
            try:
                messages.append(systemd.recv(4096).decode())
            except TimeoutError:
                return messages

    def deliver(index: int, message: str) -> None:
        senders[index].send(message.encode())
        relay.read(relay.sockets[index])

    deliver(0, "READY=1")
    deliver(0, "WATCHDOG=1")
    relay.tick()
    assert heard() == []  # API process 1 is not ready yet
    deliver(1, "STATUS=engine ready")  # only API process 0's status is passed on
    deliver(1, "READY=1")
    assert heard() == ["READY=1"]
    relay.tick()
    assert heard() == []  # API process 1 has not pinged
    deliver(1, "WATCHDOG=1")
    relay.tick()
    assert heard() == ["WATCHDOG=1"]
    for sock in (*senders, systemd, *relay.sockets):
        sock.close()


def test_an_api_process_sizes_its_rebuilds_by_the_owners_spare() -> None:
    from server.guard.hold import RebuildPath
    from server.scaleout.control import SparePath
    from server.scaleout.remote import OwnersSpare

    link, owner = _link()
    spare = OwnersSpare(link)
    link.start()
    assert spare.path() is RebuildPath.COLD and spare.pids() == set()
    owner.send(SparePath(RebuildPath.SPARE))
    deadline = time.monotonic() + 5
    while spare.path() is not RebuildPath.SPARE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spare.arm() is RebuildPath.SPARE  # the path the rebuild takes, measured under it
    owner.close()


def test_a_send_to_a_process_that_reads_nothing_never_blocks_and_is_bounded() -> None:
    """Hostile review: a SIGSTOPped API process stopped reading its pipe, the owner's send blocked, and with it
    the owner's loop and then the other API process's event loop."""
    from server.scaleout.outbox import Outbox

    sender, _stopped = multiprocessing.Pipe()  # the receiving end is never read
    outbox = Outbox(sender, "a stopped process", limit=100)
    started = time.monotonic()
    results = [outbox.put(b"x" * 100_000) for _ in range(300)]  # far more than a pipe buffer holds
    assert time.monotonic() - started < 2
    assert results.count(False) == outbox.dropped >= 100  # at most the limit waits (one more is in the send)


def test_peers_changes_wait_bounded_and_count_when_they_were_made() -> None:
    from server.guard.peers import Received

    received = Received(limit=3)
    for i in range(5):
        received.add(Change("strikes", (f"fp{i}",), float(i)))
    assert [c.values for c in received.take()] == [("fp2",), ("fp3",), ("fp4",)]  # the oldest dropped
    now = [100.0]
    budget = ClientBudget(2, window_s=10, cooldown_s=30, clock=lambda: now[0])
    budget.received.add(Change("client_faults", ("key:a",), 85.0))  # a peer's, 15 s ago: out of the window
    budget.charge(["key:a"])
    assert budget.refused_for("key:a") == 0
    budget.received.add(Change("client_faults", ("key:a",), 95.0))  # 5 s ago: in it, with this one
    assert budget.refused_for("key:a") == 25.0  # refused from when that fault was made
