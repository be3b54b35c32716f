"""The contract between vlguard's API process and the code it loads into vLLM's engine processes.

Both sides import this module and nothing of each other. It holds:

- **the environment** the API process writes before vLLM starts an engine and the engine processes read:
  :class:`EngineSettings` (per engine: written before every build, applied again when a spare process
  is handed over) and :class:`ServeSettings` (per ``vlguard serve`` process: written once);
- **the state directory**: one per ``vlguard serve`` (:func:`new_state_dir`), one directory per engine in
  it (:func:`engine_dir`), where an engine core writes its records;
- **the records**: :class:`FatalRecord` (``fatal-<pid>.json``, written by the engine core before it dies)
  and :class:`SoftFault` (``soft-<pid>-<n>.json``, written when it absorbed a step fault), each with its
  writer and reader;
- **the cut**: a request soft recovery cut reaches the API side as an ``ERROR`` finish with no tokens,
  sent only after its :class:`SoftFault` record is written (the API side reads the records when such a
  finish arrives; any other ``ERROR`` finish is vLLM's own);
- **request ids**: vLLM's engine-side id of an API-side request is ``<request id>-<8 hex>`` and
  ``<index>_<request id>-<8 hex>`` for the samples of an ``n > 1`` request (:func:`request_bases`,
  :func:`api_ids`).

The parent watch's two variables are defined in :mod:`server.engine.parent_watch`, which a new process
loads by file before anything else (it can import nothing of vlguard); they are re-exported here.
"""

from __future__ import annotations

import json
import os
import re
import traceback
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from server import run_dirs
from server.engine.parent_watch import ENV as PARENT_WATCH_ENV
from server.engine.parent_watch import PARENT_ENV as PARENT_PID_ENV

__all__ = [
    "PARENT_PID_ENV",
    "PARENT_WATCH_ENV",
    "PER_ENGINE_ENV",
    "EngineSettings",
    "FatalRecord",
    "ServeSettings",
    "SoftFault",
    "api_ids",
    "engine_dir",
    "new_state_dir",
    "read_fatal",
    "read_soft_faults",
    "request_bases",
    "write_fatal",
    "write_soft_fault",
]

# -- the environment ------------------------------------------------------------------------------------
STATE_DIR_ENV = "VLGUARD_STATE_DIR"
SOFT_RECOVERY_ENV = "VLGUARD_SOFT_RECOVERY"
SOFT_RECOVERY_MAX_ENV = "VLGUARD_SOFT_RECOVERY_MAX"
SOFT_RECOVERY_WINDOW_ENV = "VLGUARD_SOFT_RECOVERY_WINDOW"
PATCHES_ENV = "VLGUARD_PATCHES"
REPLAY_CACHE_ENV = "VLGUARD_REPLAY_CACHE"
ALIGNMENT_MAX_CAPTURE_ENV = "VLGUARD_ALIGNMENT_MAX_CAPTURE_SIZE"

#: Variables that differ from one engine to the next: a spare process spawned for one engine is handed
#: over to the next with these applied (:mod:`server.engine.spare`).
PER_ENGINE_ENV = frozenset({STATE_DIR_ENV, SOFT_RECOVERY_ENV, SOFT_RECOVERY_MAX_ENV, SOFT_RECOVERY_WINDOW_ENV})
#: Variables that name the process itself (each watched process sets its own pid for its children).
PER_PROCESS_ENV = frozenset({PARENT_PID_ENV})

_OFF = ("off", "0", "false", "no")


def _on(value: str | None, default: bool) -> bool:
    return default if value is None else value.strip().lower() not in _OFF


@dataclass(frozen=True)
class EngineSettings:
    """What one engine's processes are told: written into the environment before the build (vLLM's engine
    core inherits it), read there by the fatal recorder and soft recovery.

    Attributes:
        state_dir: this engine's own directory (:func:`engine_dir`); "" outside ``vlguard serve`` (the
            engine-side hooks then stay off).
        soft_recovery: ``--guard-soft-recovery``.
        soft_recovery_max: ``--guard-soft-recovery-max`` (recoveries within ``soft_recovery_window``).
        soft_recovery_window: ``--guard-restart-window`` (seconds).
    """

    state_dir: str = ""
    soft_recovery: bool = True
    soft_recovery_max: int = 10
    soft_recovery_window: float = 600.0

    def environ(self) -> dict[str, str]:
        """The variables, as written."""
        return {
            STATE_DIR_ENV: self.state_dir,
            SOFT_RECOVERY_ENV: "on" if self.soft_recovery else "off",
            SOFT_RECOVERY_MAX_ENV: str(self.soft_recovery_max),
            SOFT_RECOVERY_WINDOW_ENV: str(self.soft_recovery_window),
        }

    def apply(self, environ: MutableMapping[str, str] = os.environ) -> None:
        """Write the variables (before building the engine they are meant for)."""
        environ.update(self.environ())

    @staticmethod
    def state_dir_of(environ: Mapping[str, str] = os.environ) -> str:
        """The engine's state directory alone ("" outside ``vlguard serve``): what the engine-side hooks
        need to decide whether to install, readable before the rest is written (the API process loads the
        plugins before its first build writes the soft-recovery policy)."""
        return environ.get(STATE_DIR_ENV, "")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> EngineSettings:
        """What the API process wrote (defaults where unset).

        Raises:
            ValueError: a number that does not parse.
        """
        return cls(
            state_dir=environ.get(STATE_DIR_ENV, ""),
            soft_recovery=_on(environ.get(SOFT_RECOVERY_ENV), True),
            soft_recovery_max=int(environ.get(SOFT_RECOVERY_MAX_ENV) or 10),
            soft_recovery_window=float(environ.get(SOFT_RECOVERY_WINDOW_ENV) or 600.0),
        )


@dataclass(frozen=True)
class ServeSettings:
    """What every vLLM process of one ``vlguard serve`` is told, written once before vLLM loads its
    plugins (spawned processes inherit it).

    Attributes:
        patches: ``--guard-patches`` (the deepstack backports and the compile-cache fix).
        replay_cache: the engine processes keep the receiver half of vLLM's processor cache
            (:mod:`server.vllm_hooks.processor_cache`).
        alignment_max_capture_size: ``--guard-alignment-max-capture-size`` (0: the engine's own).
    """

    patches: bool = True
    replay_cache: bool = False
    alignment_max_capture_size: int = 0

    def apply(self, environ: MutableMapping[str, str] = os.environ) -> None:
        """Write the variables (``replay_cache`` off removes its variable)."""
        environ[PATCHES_ENV] = "on" if self.patches else "off"
        if self.replay_cache:
            environ[REPLAY_CACHE_ENV] = "1"
        else:
            environ.pop(REPLAY_CACHE_ENV, None)
        if self.alignment_max_capture_size:
            environ[ALIGNMENT_MAX_CAPTURE_ENV] = str(self.alignment_max_capture_size)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> ServeSettings:
        """What ``vlguard serve`` wrote (patches on, the rest off where unset)."""
        return cls(
            patches=_on(environ.get(PATCHES_ENV), True),
            replay_cache=environ.get(REPLAY_CACHE_ENV) == "1",
            alignment_max_capture_size=int(environ.get(ALIGNMENT_MAX_CAPTURE_ENV, "0") or 0),
        )


# -- the state directory --------------------------------------------------------------------------------
def new_state_dir() -> str:
    """A new state directory for one ``vlguard serve`` (removed by the supervisor at shutdown, and however the
    process ends: :func:`server.run_dirs.make`)."""
    return str(run_dirs.make("state"))


def engine_dir(state_dir: str | Path, generation: int) -> Path:
    """Engine ``generation``'s own directory in ``state_dir``: its records, and nothing else's."""
    return Path(state_dir) / f"engine-{generation}"


# -- the records ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FatalRecord:
    """What an engine core recorded before dying (``fatal-<pid>.json``).

    Attributes:
        type: the exception's class name.
        message: its message (at most 2000 characters).
        step_requests: engine-side request ids charged with the fault: the request(s) the failing code was
            handling when it names them, else those of the step(s) being executed.
        new_requests: those of them that were scheduled for the first time in that step.
        suspects: when nothing could be charged (a fault in ``schedule()`` or outside a step that named no
            request), every request the scheduler held: they re-enter one at a time on probation, so the
            next fault names the culprit.
        named: whether ``step_requests`` were named by the failing code itself (not the whole step's).
        traceback: the exception's formatted traceback, its last :data:`TRACEBACK_CHARS` characters (the
            innermost frames), for the forensic record (:mod:`server.guard.forensics`).
    """

    type: str
    message: str
    step_requests: list[str] = field(default_factory=list)
    new_requests: list[str] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)
    named: bool = False
    traceback: str = ""

    def describe(self) -> str:
        """``"<Type>: <message>"``."""
        return f"{self.type}: {self.message}"


@dataclass(frozen=True)
class SoftFault:
    """What an engine core recorded when it absorbed a fault (``soft-<pid>-<n>.json``).

    Attributes:
        type, message: the exception (message at most 2000 characters).
        step_requests, new_requests, suspects, named: as in :class:`FatalRecord`.
        cut: engine-side ids of every request finished with ``ERROR`` for the guard to carry over.
        recovery_s: seconds from the exception to the engine accepting work again.
        traceback: as in :class:`FatalRecord`.
    """

    type: str
    message: str
    step_requests: list[str]
    new_requests: list[str]
    cut: list[str]
    recovery_s: float
    suspects: list[str] = field(default_factory=list)
    named: bool = False
    traceback: str = ""

    def describe(self) -> str:
        """``"<Type>: <message>"``."""
        return f"{self.type}: {self.message}"


#: Characters of a fault's formatted traceback kept in its record (the innermost frames are last).
TRACEBACK_CHARS = 8000


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it (chained exceptions included), its last
    :data:`TRACEBACK_CHARS` characters."""
    return "".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:]


def _directory(directory: str | Path) -> Path:
    if not str(directory):
        raise OSError("no state directory (not an engine of vlguard serve)")
    return Path(directory)


def write_fatal(directory: str | Path, record: FatalRecord, pid: int | None = None) -> Path:
    """Write ``record`` as this (or ``pid``'s) engine core's fatal record in ``directory``.

    Raises:
        OSError: the file could not be written, or ``directory`` is empty.
    """
    path = _directory(directory) / f"fatal-{pid or os.getpid()}.json"
    path.write_text(json.dumps(asdict(record)))
    return path


def read_fatal(directory: str | Path) -> FatalRecord | None:
    """The fatal record an engine core wrote in ``directory`` (an engine's own), or None."""
    for path in sorted(Path(directory).glob("fatal-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return FatalRecord(
            type=str(data.get("type")),
            message=str(data.get("message")),
            step_requests=[str(r) for r in data.get("step_requests") or []],
            new_requests=[str(r) for r in data.get("new_requests") or []],
            suspects=[str(r) for r in data.get("suspects") or []],
            named=bool(data.get("named")),
            traceback=str(data.get("traceback") or ""),
        )
    return None


def write_soft_fault(directory: str | Path, record: SoftFault, seq: int) -> Path:
    """Write ``record`` as this engine core's ``seq``-th soft-fault record in ``directory``.

    Raises:
        OSError: the file could not be written, or ``directory`` is empty.
    """
    path = _directory(directory) / f"soft-{os.getpid()}-{seq}.json"
    path.write_text(json.dumps(asdict(record)))
    return path


def read_soft_faults(directory: str | Path, skip: Iterable[str] = ()) -> list[tuple[str, SoftFault]]:
    """The soft-fault records in ``directory`` (an engine's own) whose file names are not in ``skip``,
    oldest first, as ``(file name, record)``. Unreadable files are skipped (read again later)."""
    seen, found = set(skip), []
    paths = sorted(Path(directory).glob("soft-*.json"), key=lambda p: (len(p.name), p.name))
    for path in paths:
        if path.name in seen:
            continue
        try:
            data = json.loads(path.read_text())
            record = SoftFault(
                type=str(data["type"]),
                message=str(data["message"]),
                step_requests=[str(r) for r in data["step_requests"]],
                new_requests=[str(r) for r in data["new_requests"]],
                cut=[str(r) for r in data["cut"]],
                recovery_s=float(data["recovery_s"]),
                suspects=[str(r) for r in data.get("suspects") or []],
                named=bool(data.get("named")),
                traceback=str(data.get("traceback") or ""),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append((path.name, record))
    return found


# -- request ids ----------------------------------------------------------------------------------------
_SAMPLE_PREFIX = re.compile(r"^\d+_")  # vLLM's ids of an n > 1 request's samples: "<index>_<request id>"


def request_bases(engine_ids: Iterable[str]) -> set[str]:
    """The API-side request ids behind engine-side ids: ``<request id>-<8 hex>`` loses its suffix (a replay
    of the same request gets a new one)."""
    return {rid.rsplit("-", 1)[0] for rid in engine_ids}


def api_ids(engine_ids: Iterable[str]) -> set[str]:
    """Every id an API-side request may go by for these engine-side ids (the id itself, without its
    suffix, and without an ``n > 1`` sample's prefix)."""
    ids = set()
    for engine_id in engine_ids:
        base = engine_id.rsplit("-", 1)[0]
        ids |= {engine_id, base, _SAMPLE_PREFIX.sub("", base)}
    return ids
