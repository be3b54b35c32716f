"""systemd service notifications (``Type=notify``, ``WatchdogSec=``) through the sdnotify library.

Everything is a no-op outside systemd (no ``NOTIFY_SOCKET``). ``WATCHDOG=1`` is sent at half the
interval systemd asks for (``WATCHDOG_USEC``), and only while the supervisor is healthy: a FAILED
supervisor or a stuck event loop stops the pings, and systemd restarts the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import sdnotify

logger = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages when running under systemd."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self.enabled else None
        usec = os.environ.get("WATCHDOG_USEC")
        self.watchdog_interval_s = int(usec) / 2e6 if usec and usec.isdigit() else None

    def send(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)

    def ready(self) -> None:
        self.send("READY=1")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    async def watchdog_forever(self, healthy: Callable[[], bool]) -> None:
        """Ping ``WATCHDOG=1`` every half interval while ``healthy()``; never returns."""
        if self.watchdog_interval_s is None:
            return
        while True:
            if healthy():
                self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval_s)
