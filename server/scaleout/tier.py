"""The owner process's loop under ``--api-server-count N``: N API processes and the engine core they share,
from start to exit (what each part does: :mod:`server.scaleout.owner`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from server import run_dirs
from server.guard.hold import RebuildPath
from server.guard.spare import SpareKeeper
from server.scaleout import api_process
from server.scaleout.control import EngineDown, EngineUp, Progress, Shared, SparePath
from server.scaleout.outbox import Outbox
from server.scaleout.owner import EngineOwner, NotifyRelay, unsupported_reason
from server.settings import GuardSettings

logger = logging.getLogger("server.scaleout")

#: Exit statuses (:mod:`server.serve`'s).
EXIT_STARTUP_FAILED, EXIT_ENGINE_FAILED, EXIT_API_PROCESS_ENDED = 3, 4, 5
#: How often the loop looks at what has no file descriptor to wait on (spare, watchdog pings), seconds.
TICK_S = 1.0
#: Messages taken from one API process's pipe per wake of the loop, at most.
FORWARD_AT_ONCE = 64


def run(args: argparse.Namespace, settings: GuardSettings, sock: socket.socket, state_dir: str, count: int) -> int:
    """Serve with ``count`` API processes until SIGTERM/SIGINT or until one of them ends.

    Returns:
        3 when the first engine did not come up (or an API process could not start); 4 when an API process's
        guard gave up or the engine could not be launched again; 5 when an API process ended otherwise (killed,
        crashed): as vLLM's launcher does, every process then ends. After a SIGTERM/SIGINT the process ends by
        that signal (143 / 130).
    """
    if (why := unsupported_reason()) is not None:
        logger.critical("--api-server-count %d: %s", count, why)
        return EXIT_STARTUP_FAILED
    try:
        tier = Tier(args, settings, sock, state_dir, count)
    except Exception:  # vLLM refused the configuration: as the single process's first build failing
        logger.exception("cannot start: the engine's configuration failed")
        shutil.rmtree(state_dir, ignore_errors=True)
        return EXIT_STARTUP_FAILED
    try:
        status = tier.serve()
    finally:
        tier.stop()
    for sig in tier.signals[-1:]:
        run_dirs.remove_all()  # the signal's default action runs no exit handler
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)
    return status


def _import_model_class(config: Any) -> None:
    """Import the served model's class, as a single API process has (its renderer does) before it spawns a
    spare: vLLM's imports set environment variables (``UCX_RCACHE_MAX_UNRELEASED``) that the engine core's
    children inherit, and a worker spare spawned without them is refused at the hand-over (seen: a rebuild
    through the spare engine core but a cold worker, 21.5 s instead of ~5)."""
    from vllm.model_executor.models import ModelRegistry

    try:
        ModelRegistry.resolve_model_cls(config.model_config.architectures, config.model_config)
    except Exception:  # the engine core will say what is wrong with the model
        logger.warning("the model's class did not import in the owner", exc_info=True)


class Tier:
    """The owner's processes and its loop (:meth:`serve`), and their end (:meth:`stop`)."""

    def __init__(
        self, args: argparse.Namespace, settings: GuardSettings, sock: socket.socket, state_dir: str, count: int
    ) -> None:
        from server import serve

        self.args, self.settings, self.sock, self.state_dir, self.count = args, settings, sock, state_dir, count
        self.signals: list[int] = []
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda received, _frame: self.signals.append(received))
        engine_args = serve.engine_args(args, settings)
        engine_args._api_process_count, engine_args._api_process_rank = count, -1
        from vllm.usage.usage_lib import UsageContext

        self.config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        _import_model_class(self.config)
        self.spares = SpareKeeper() if settings.spare else None
        log_stats = not engine_args.disable_log_stats
        self.owner = EngineOwner(self.config, count, log_stats, settings, state_dir, self.spares)
        self.relay = NotifyRelay(count, state_dir)
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.outboxes: list[Outbox] = []  # to each API process: sends never block the loop
        self._launch: threading.Thread | None = None
        self._launched: list[EngineUp] | BaseException | None = None
        self._next_launch_at = 0.0
        self._checking: threading.Thread | None = None  # the spare's check, one at a time
        self._told_path = RebuildPath.COLD  # what the API processes were last told of the spare
        self._failures = 0

    # -- start ------------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Start the N API processes (their imports and app run while the first engine loads)."""
        ctx = multiprocessing.get_context("spawn")
        for index in range(self.count):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=api_process.main,
                name=f"vlguard-api-{index}",
                args=(self.args, self.settings, self.sock, index, self.count, theirs, self.relay.environ(index)),
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
            self.outboxes.append(Outbox(mine, f"API process {index}"))
        logger.info("API processes started: %s", ", ".join(str(p.pid) for p in self.procs))
        # Each API process has its own descriptor of the socket now. Closed here, the socket closes with the
        # last API process's listener: a SIGTERM's drain refuses new connections, as one process's does.
        self.sock.close()

    def _start_launch(self) -> None:
        def launch() -> None:
            try:
                self._launched = self.owner.launch()
            except BaseException as exc:  # handed to the loop
                self._launched = exc
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

        self._launched = None
        self._launch = threading.Thread(target=launch, name="vlguard-engine-launch", daemon=True)
        self._launch.start()

    def _send(self, messages: list[Any]) -> None:
        for outbox, message in zip(self.outboxes, messages, strict=True):
            outbox.put(message)

    # -- the loop ---------------------------------------------------------------------------------------
    def serve(self) -> int:
        """Until a signal or until an API process ends; the status :func:`run` returns without a signal."""
        self._spawn()
        if self.spares is not None:
            self.spares.on_config(self.config)
        self._start_launch()
        first, last_tick = True, 0.0
        while not self.signals:
            launching = self._launch is not None and self._launch.is_alive()
            self._wait(launching)
            if self.signals:
                break
            if (status := self._api_process_ended()) is not None:
                return status
            if not launching and self._launch is not None:  # a launch ended
                status, first = self._launched_engine(first), False
                if status is not None:
                    return status
            elif not launching and self.owner.died():
                logger.error("engine %d: its engine core ended; launching the next", self.owner.generation)
                self._send([EngineDown(self.owner.generation)] * self.count)
                self._start_launch()
            elif self._launch is None and self._failures and time.monotonic() >= self._next_launch_at:
                self._start_launch()  # the next try after a failed launch's back-off
            if time.monotonic() - last_tick >= TICK_S:
                last_tick = time.monotonic()
                self._tick(launching)
        return 0

    def _wait(self, launching: bool) -> None:
        """Until something happens (a launch ended, a process ended, a message, a signal) or :data:`TICK_S`."""
        waiting: list[Any] = [self._wake_r, *(p.sentinel for p in self.procs), *self.relay.sockets, *self.conns]
        if not launching:
            waiting += self.owner.sentinels()
        for ready in wait(waiting, timeout=TICK_S):
            if ready is self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
            elif ready in self.relay.sockets:
                self.relay.read(ready)
            elif ready in self.conns:
                self._forward(ready)

    def _api_process_ended(self) -> int | None:
        """The status to exit with when an API process ended on its own; None while all run."""
        if (ended := next((p for p in self.procs if p.exitcode is not None), None)) is None:
            return None
        logger.error("API process %s ended (status %s): stopping every process", ended.pid, ended.exitcode)
        return ended.exitcode if ended.exitcode in (EXIT_STARTUP_FAILED, EXIT_ENGINE_FAILED) else EXIT_API_PROCESS_ENDED

    def _tick(self, launching: bool) -> None:
        """systemd's watchdog, and the spare (its check off the loop, one at a time: replacing a dead spare
        spawns, which pickles the configuration)."""
        self.relay.tick()
        if self.spares is not None and (path := self.spares.path()) is not self._told_path:
            self._told_path = path
            self._send([SparePath(path)] * self.count)
        if self.spares is None or launching or (self._checking is not None and self._checking.is_alive()):
            return
        self._checking = threading.Thread(target=self.spares.check, name="vlguard-spare-check", daemon=True)
        self._checking.start()

    def _forward(self, conn: Connection) -> None:
        """Messages from an API process (at most :data:`FORWARD_AT_ONCE` a wake: one that sends without end does
        not hold the loop): a shared change goes to every other one, and so does a progress note, to those
        that have read everything sent to them (a note is worth only its newest)."""
        with contextlib.suppress(EOFError, OSError):  # an API process that ended: the loop sees it
            for _ in range(FORWARD_AT_ONCE):
                if not conn.poll():
                    return
                message = conn.recv()
                others = [o for c, o in zip(self.conns, self.outboxes, strict=True) if c is not conn]
                if isinstance(message, Shared):
                    for outbox in others:
                        outbox.put(message)
                elif isinstance(message, Progress):
                    for outbox in others:
                        if outbox.idle():
                            outbox.put(message)

    def _launched_engine(self, first: bool) -> int | None:
        """A launch ended: announce the engine, or count the failure (a status when giving up)."""
        result, self._launch = self._launched, None
        if isinstance(result, list):
            self._failures = 0
            self._send(result)
            logger.info("engine %d up: announced to %d API processes", self.owner.generation, self.count)
            if self.spares is not None:
                spares, config = self.spares, self.config
                threading.Thread(target=spares.replenish, args=(config,), daemon=True).start()
            return None
        logger.error("engine %d did not come up: %r", self.owner.generation, result)
        self.owner.end()
        if first:
            return EXIT_STARTUP_FAILED
        self._failures += 1
        if self._failures > self.settings.restart_max:
            logger.critical("the engine could not be launched %d times in a row: giving up", self._failures)
            return EXIT_ENGINE_FAILED
        self._next_launch_at = time.monotonic() + self.settings.restart_backoff * 2 ** (self._failures - 1)
        return None

    # -- the end ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM the API processes (each drains), wait for them, then end the engine and the spare. Each
        stage is bounded (the drain, then ``shutdown_timeout`` seconds). Never raises."""
        self.relay.notifier.stopping()
        if self.owner.manager is None:  # no engine is coming: a build waiting for one gives up at once
            for conn in self.conns:
                conn.close()
        for proc in self.procs:
            if proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout + self.settings.shutdown_timeout + 5
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                logger.error("API process %s did not end in time: killing it", proc.pid)
                proc.kill()
                proc.join(5)
        if self.spares is not None:
            self.spares.close()
        self.owner.end(timeout=self.settings.shutdown_timeout)
        signal.set_wakeup_fd(-1)
        shutil.rmtree(self.state_dir, ignore_errors=True)
