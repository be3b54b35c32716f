"""The guard's per-server state across N API processes (:mod:`server.guard.peers`): this API process's changes
go to the owner, which forwards them to the others; theirs come back and are taken in at the next read. And the
hang clock: another API process's step outputs are progress here too (:class:`~server.scaleout.control.Progress`)."""

from __future__ import annotations

from server.guard.peers import Change
from server.guard.supervisor import Supervisor
from server.scaleout.control import Progress, Shared
from server.scaleout.link import OwnerLink


class SharedGuardState:
    """Connects ``supervisor``'s quarantine and client budgets to the other API processes over ``link``.

    Arguments:
        link: this API process's link to the owner.
        index: this API process's index (the origin of what it publishes).
    """

    def __init__(self, link: OwnerLink, index: int) -> None:
        self.link, self.index = link, index
        self.supervisor: Supervisor | None = None
        link.on(Shared, self._received)
        link.on(Progress, self._progressed)

    def attach(self, supervisor: Supervisor) -> None:
        """Share ``supervisor``'s quarantine and per-client fault budgets from now on."""
        self.supervisor = supervisor
        supervisor.quarantine.peers = supervisor.clients.peers = self

    def publish(self, change: Change) -> None:
        self.link.send(Shared(self.index, change))

    def _progressed(self, _: Progress) -> None:  # on the link's thread: one float written
        if (supervisor := self.supervisor) is not None:
            supervisor.watch.note_step()  # the engine core stepped for another API process

    def _received(self, shared: Shared) -> None:  # on the link's thread
        if (supervisor := self.supervisor) is None:
            return
        if shared.change.kind == "client_faults":
            supervisor.clients.received.add(shared.change)
        else:
            supervisor.quarantine.received.add(shared.change)


__all__ = ["SharedGuardState"]
