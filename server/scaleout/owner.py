"""The owner of the engine's life under ``--api-server-count N`` (N > 1).

vLLM's layout (``vllm serve --api-server-count N``): one process launches the engine core with vLLM's
``launch_core_engines(..., N)`` and N API processes serve HTTP on one listening socket, each a client of that
engine core on its own ZMQ addresses. The owner does the same, and keeps doing it:

* it spawns the N API processes (:func:`server.scaleout.api_process.main`: vlguard's app, door and guard, over
  :class:`~server.scaleout.remote.RemoteEngines`), then launches the engine core and announces it to each
  (:class:`~server.scaleout.control.EngineUp`);
* when the engine core's process ends (a crash, a kill, or an API process's guard ending a hung or stopped one),
  it announces the death (:class:`~server.scaleout.control.EngineDown`) and launches the next engine core,
  through the spare engine process when one is ready (:class:`~server.guard.spare.SpareKeeper`); each API
  process's guard carries its own requests over to it;
* each API process's guard keeps the restart budget of the deaths it sees; one that spends it exits 4, and
  the owner then ends every process and exits with that status (as vLLM ends all when one API process ends);
* systemd: each API process's notifications come to a socket of the owner's (``NOTIFY_SOCKET``); the owner sends
  ``READY=1`` once all N are ready and ``WATCHDOG=1`` while all N ping (:class:`NotifyRelay`);
* SIGTERM/SIGINT: the owner passes SIGTERM to the API processes (each drains its requests), waits for them,
  then ends the engine and the spare.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import socket
import time
from typing import Any

from server.engine.protocol import EngineSettings, engine_dir
from server.guard.spare import SpareKeeper
from server.guard.systemd import Notifier
from server.scaleout.control import EngineUp
from server.settings import GuardSettings

logger = logging.getLogger("server.scaleout")


def unsupported_reason() -> str | None:
    """Why this vLLM's launcher cannot be driven for N API processes here, or None when it can.

    vLLM 0.20-0.22's ``launch_core_engines(config, executor, log_stats, addresses, num_api_servers)`` hands
    each API process a pair of addresses its client binds; later versions bind the listeners in the launching
    process (``bind_engine_zmq_listeners``), which a reconnect would need to hand over again.
    """
    from vllm.v1.engine import utils

    if "num_api_servers" not in inspect.signature(utils.launch_core_engines).parameters:
        return "this vLLM binds the API processes' ZMQ listeners itself; vlguard drives vLLM 0.20-0.22's launcher only"
    return None


class EngineOwner:
    """Launches the engine core N API processes share, one generation at a time, and ends it.

    Arguments:
        config: vLLM's configuration for the owner (``_api_process_count`` N, rank -1).
        count: N.
        log_stats: whether the engine core sends statistics (not ``--disable-log-stats``).
        settings: soft recovery's settings for the engine core.
        state_dir: below it, each engine's record directory.
        spares: the spare engine process for rebuilds, or None.
    """

    def __init__(
        self,
        config: Any,
        count: int,
        log_stats: bool,
        settings: GuardSettings,
        state_dir: str,
        spares: SpareKeeper | None,
    ) -> None:
        self.config, self.count, self.log_stats, self.settings = config, count, log_stats, settings
        self.state_dir, self.spares = state_dir, spares
        self.generation = 0
        self.manager: Any = None  # vLLM's CoreEngineProcManager of the current engine

    def launch(self) -> list[EngineUp]:
        """End the current engine's processes, launch the next and wait for its handshake (blocks for the
        whole model load). Returns what to tell each API process.

        Raises:
            RuntimeError: vLLM made a tensor queue (it can only be inherited, not sent to a running process).
            Exception: whatever vLLM raised.
        """
        from vllm.v1.engine.utils import CoreEngineProcManager, get_engine_zmq_addresses, launch_core_engines
        from vllm.v1.executor import Executor

        self.end()
        self.generation += 1
        directory = engine_dir(self.state_dir, self.generation)
        directory.mkdir(parents=True, exist_ok=True)
        s = self.settings  # inherited by the engine core this launch spawns
        EngineSettings(str(directory), s.soft_recovery, s.soft_recovery_max, s.restart_window).apply()
        if self.generation > 1 and self.spares is not None:
            self.spares.arm()
        try:
            addresses = get_engine_zmq_addresses(self.config, self.count)
            executor = Executor.get_class(self.config)
            with launch_core_engines(self.config, executor, self.log_stats, addresses, self.count) as launched:
                manager, _, addresses, queue = launched
        finally:
            if self.spares is not None:
                self.spares.after_build()
        if not isinstance(manager, CoreEngineProcManager):  # Ray actors, or engines elsewhere (data parallel)
            raise RuntimeError("vlguard drives local engine-core processes only")
        self.manager = manager
        if queue is not None:
            raise RuntimeError("vLLM's tensor queue cannot be handed to running API processes")
        pids = tuple(p.pid for p in manager.processes if p.pid is not None)
        return [
            EngineUp(self.generation, str(directory), pids, {"input_address": i, "output_address": o})
            for i, o in zip(addresses.inputs, addresses.outputs, strict=True)
        ]

    def sentinels(self) -> list[int]:
        """The current engine's processes' sentinels (ready when one ends)."""
        if self.manager is None:
            return []
        return [p.sentinel for p in self.manager.processes]

    def died(self) -> bool:
        """Whether a process of the current engine has ended."""
        return self.manager is not None and any(p.exitcode is not None for p in self.manager.processes)

    def end(self, timeout: float | None = None) -> None:
        """End the current engine's processes (vLLM's manager: SIGTERM, then SIGKILL). Idempotent."""
        manager, self.manager = self.manager, None
        if manager is not None:
            with contextlib.suppress(Exception):
                manager.shutdown(timeout=timeout)


class NotifyRelay:
    """systemd's notifications for N API processes: each gets a datagram socket of its own as ``NOTIFY_SOCKET``
    (``WATCHDOG_USEC`` it inherits, so each pings at half systemd's interval, as one process does); the owner
    sends ``READY=1`` once every one sent it, ``WATCHDOG=1`` while every one pinged within systemd's whole
    interval, and API process 0's ``STATUS=``. No-op outside systemd."""

    def __init__(self, count: int, directory: str) -> None:
        self.notifier = Notifier()
        self.sockets: list[socket.socket] = []
        self.paths: list[str] = []
        self.ready: set[int] = set()
        self.last_ping: dict[int, float] = {}
        self._readied = False
        if not self.notifier.enabled:
            return
        for i in range(count):
            path = os.path.join(directory, f"notify-{i}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(path)
            sock.setblocking(False)
            self.sockets.append(sock)
            self.paths.append(path)

    def environ(self, index: int) -> dict[str, str]:
        """What API process ``index`` is started with (nothing outside systemd)."""
        return {"NOTIFY_SOCKET": self.paths[index]} if self.sockets else {}

    def read(self, ready_socket: Any) -> None:
        index = self.sockets.index(ready_socket)
        with contextlib.suppress(BlockingIOError):
            while True:
                for line in ready_socket.recv(4096).decode(errors="replace").splitlines():
                    if line == "READY=1":
                        self.ready.add(index)
                    elif line == "WATCHDOG=1":
                        self.last_ping[index] = time.monotonic()
                    elif line.startswith("STATUS=") and index == 0:
                        self.notifier.send(line)
        if not self._readied and len(self.ready) == len(self.sockets):
            self._readied = True
            self.notifier.ready()

    def tick(self) -> None:
        """Ping systemd's watchdog if every API process pinged within its interval."""
        interval = self.notifier.watchdog_interval_s
        if interval is None or not self._readied:
            return
        now = time.monotonic()
        # interval is half systemd's (the ping period): each API process pinged within systemd's whole interval
        if all(now - self.last_ping.get(i, 0.0) <= 2 * interval for i in range(len(self.sockets))):
            self.notifier.send("WATCHDOG=1")


__all__ = ["EngineOwner", "NotifyRelay", "unsupported_reason"]
