"""Messages to another process of the server, sent by a thread of their own: a send never blocks its caller (the
event loop of an API process, or the owner's loop), whatever the receiver does. A stopped process stops reading
its pipe, and a blocking send then waits with it (seen: one SIGSTOPped API process froze the owner, then the
other API process's event loop)."""

from __future__ import annotations

import logging
import queue
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger("server.scaleout")

#: Messages waiting for one receiver at most; past that the newest are dropped (its receiver is stuck).
LIMIT = 10_000


class Outbox:
    """Arguments:
    conn: the pipe end to send on (this thread is its only sender).
    name: whom it sends to, for the log."""

    def __init__(self, conn: Connection, name: str, limit: int = LIMIT) -> None:
        self.conn, self.name = conn, name
        self.dropped = 0
        self._queue: queue.Queue[object] = queue.Queue(limit)
        threading.Thread(target=self._run, name=f"vlguard-outbox-{name}", daemon=True).start()

    def put(self, message: object) -> bool:
        """Queue ``message`` (never blocks). False when the receiver has :data:`LIMIT` waiting: it is dropped."""
        try:
            self._queue.put_nowait(message)
            return True
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.error("%s reads nothing: %d message(s) to it dropped", self.name, self.dropped)
            return False

    def idle(self) -> bool:
        """Nothing waits to be sent."""
        return self._queue.empty()

    def _run(self) -> None:
        while True:
            message = self._queue.get()
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the receiver is gone (its end closed): the sender's loop sees it
                return


__all__ = ["LIMIT", "Outbox"]
