"""A systemd-style ``NOTIFY_SOCKET`` for tests: records every ``sd_notify`` message a server sends."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


class NotifySocket:
    """A systemd-style NOTIFY_SOCKET (unix datagram) that records every message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self._sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_for(self, prefix: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msg in list(self.messages):
                if msg.startswith(prefix):
                    return msg
            time.sleep(0.1)
        raise AssertionError(f"no {prefix!r} in {self.messages}")

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
