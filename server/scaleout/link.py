"""An API process's end of its control pipe to the owner (:mod:`server.scaleout.control`): one daemon thread reads
it and hands each message to the handler registered for its type; another sends
(:class:`~server.scaleout.outbox.Outbox`: a send never blocks the event loop)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from server.scaleout.outbox import Outbox

logger = logging.getLogger("server.scaleout")


class OwnerLink:
    """The API process's end of its pipe to the owner (duplex, ``conn``). Handlers run on the reading thread;
    those given to :meth:`on_gone` once, when the owner's end closes (the owner is gone)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._handlers: dict[type, Callable[[Any], None]] = {}
        self._gone: list[Callable[[], None]] = []
        self._outbox = Outbox(conn, "the owner")
        self._thread: threading.Thread | None = None

    def on(self, kind: type, handler: Callable[[Any], None]) -> None:
        """Call ``handler(message)`` for each message of type ``kind`` (register before :meth:`start`)."""
        self._handlers[kind] = handler

    def on_gone(self, handler: Callable[[], None]) -> None:
        """Call ``handler()`` once the owner is gone (its end of the pipe closed)."""
        self._gone.append(handler)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._read, name="vlguard-owner-link", daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        """Send ``message`` to the owner (never blocks; a gone owner is not an error here: :meth:`on_gone`)."""
        self._outbox.put(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if (handler := self._handlers.get(type(message))) is None:
                logger.warning("unexpected message from the owner: %r", type(message).__name__)
                continue
            try:
                handler(message)
            except Exception:
                logger.exception("handling %s from the owner failed", type(message).__name__)
        for gone in self._gone:
            gone()


__all__ = ["OwnerLink"]
