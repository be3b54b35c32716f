"""What the owner (:mod:`server.scaleout.owner`) and an API process (:mod:`server.scaleout.remote`) tell each
other on the API process's control pipe (``multiprocessing.Pipe``; the objects are pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.guard.hold import RebuildPath
from server.guard.peers import Change


@dataclass(frozen=True)
class EngineUp:
    """Owner -> API process: engine ``generation`` answered its handshake.

    Attributes:
        generation: the owner's count of engines launched (1 for the first).
        directory: where its engine core writes its records (:mod:`server.engine.protocol`).
        pids: its engine-core process ids.
        addresses: this API process's ``client_addresses`` for vLLM's ``AsyncLLM`` (``input_address``,
            ``output_address``, and ``tensor_queue`` where vLLM has one).
    """

    generation: int
    directory: str
    pids: tuple[int, ...]
    addresses: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineDown:
    """Owner -> API process: engine ``generation``'s engine core is gone (a new one is being launched)."""

    generation: int


@dataclass(frozen=True)
class Shared:
    """API process -> owner -> every other API process: a change to a state the guard keeps per server
    (:mod:`server.guard.peers`), made in API process ``origin``."""

    origin: int
    change: Change


@dataclass(frozen=True)
class Progress:
    """API process -> owner -> every other API process: API process ``origin`` received step outputs from the
    engine core (at most one a second). A busy engine core sends a client nothing while that client's requests
    wait for others': every API process's hang clock follows every step, as one process's does."""

    origin: int


@dataclass(frozen=True)
class SparePath:
    """Owner -> API process, when it changes: the path the owner's next rebuild would take (its spare ready,
    still importing, or none): what the API process's hold and build limits are sized by."""

    path: RebuildPath


__all__ = ["EngineDown", "EngineUp", "Progress", "Shared", "SparePath"]
