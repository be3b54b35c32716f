"""An API process's end of its control pipe to the owner (:mod:`server.scaleout.control`): one daemon thread reads
it and hands each message to the handler registered for its type; sends are serialised."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("server.scaleout")


class OwnerLink:
    """Arguments:
    conn: the API process's end of its pipe (duplex).

    Handlers run on the reading thread; ``on_gone`` once, when the owner's end closes (the owner is gone)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._handlers: dict[type, Callable[[Any], None]] = {}
        self._gone: list[Callable[[], None]] = []
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def on(self, kind: type, handler: Callable[[Any], None]) -> None:
        """Call ``handler(message)`` for each message of type ``kind`` (register before :meth:`start`)."""
        self._handlers[kind] = handler

    def on_gone(self, handler: Callable[[], None]) -> None:
        self._gone.append(handler)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._read, name="vlguard-owner-link", daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        """Send ``message`` to the owner; a gone owner is not an error here (:meth:`on_gone` says so)."""
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:
            pass

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
