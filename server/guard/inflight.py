"""The in-flight ledger: which requests are inside which engine now, and who is on probation.

One object owns the registry the supervisor reads at a death (who was in flight), probation and the
``vlguard_requests_inflight`` gauge.

Probation isolates a suspect (a request with a strike on its record) so that its next fault can only be
its own: suspects run one at a time; a suspect waits until the requests already inside the engine have
finished (at most ``drain_timeout_s``; past that it runs beside them), and other requests wait at the
door from the moment the suspect takes its slot until it has produced output (its first step, where a
poison input fails, passed), ended, or run for ``drain_timeout_s`` (a non-streaming request yields no
output before it ends). The stall this costs other traffic is at most twice ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from server.guard.errors import EngineUnavailableError
from server.guard.quarantine import Fingerprint
from server.metrics import definitions as m

#: The block of a request not on probation: nothing to wait for or release (reusable).
_FREE: contextlib.nullcontext[None] = contextlib.nullcontext()


class InflightLedger:
    """Requests inside an engine, by request id.

    Arguments:
        hold_timeout_s: how long a suspect waits for the probation slot before it gets 503.
        drain_timeout_s: how long a suspect waits for the engine to empty before it runs anyway.
    """

    def __init__(self, hold_timeout_s: float, drain_timeout_s: float = 30.0) -> None:
        self.hold_timeout_s = hold_timeout_s
        self.drain_timeout_s = drain_timeout_s
        # request id -> (fingerprint, generation, client, evidence for the forensic record)
        self._requests: dict[str, tuple[Fingerprint | str, int, str, Any]] = {}
        self._probation = asyncio.Lock()
        self._empty = asyncio.Event()  # set while no request is inside an engine
        self._empty.set()
        self._door = asyncio.Event()  # cleared while a suspect is isolated
        self._door.set()

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def requests(self, generation: int) -> dict[str, str]:
        """Request id -> fingerprint of the requests inside engine ``generation`` (each computed now, if it
        was not yet: :class:`~server.guard.quarantine.Fingerprint`)."""
        return {rid: str(fp) for rid, (fp, gen, _, _) in self._requests.items() if gen == generation}

    def client_of(self, request_id: str) -> str:
        """The client (:func:`server.guard.clients.client_key`) that sent ``request_id`` ("" if unknown)."""
        entry = self._requests.get(request_id)
        return entry[2] if entry is not None else ""

    def evidence_of(self, request_id: str) -> Any:
        """What the engine client handed in for ``request_id`` (:class:`server.guard.forensics.Evidence`),
        or None."""
        entry = self._requests.get(request_id)
        return entry[3] if entry is not None else None

    @contextlib.contextmanager
    def entered(
        self, request_id: str, fp: Fingerprint | str, generation: int, client: str = "", evidence: Any = None
    ) -> Iterator[None]:
        """Record ``request_id`` (sent by ``client``) as inside engine ``generation`` for the duration of
        the block."""
        self._requests[request_id] = (fp, generation, client, evidence)
        self._empty.clear()
        m.REQUESTS_INFLIGHT.set(len(self._requests))
        try:
            yield
        finally:
            self._requests.pop(request_id, None)
            if not self._requests:
                self._empty.set()
            m.REQUESTS_INFLIGHT.set(len(self._requests))

    def suspect_progressed(self) -> None:
        """The isolated suspect produced output: its first step passed, others may join it."""
        self._door.set()

    def probation(self, suspect: bool) -> contextlib.AbstractAsyncContextManager[None]:
        """Enter the block under probation's rules (see the module docstring): isolated when ``suspect``;
        otherwise at once, or, while a suspect is isolated, once it lets others in (at most twice
        ``drain_timeout_s`` per suspect). Nothing is awaited when no suspect is isolated.

        Raises:
            EngineUnavailableError: the probation slot did not free up within ``hold_timeout_s``.
        """
        if suspect:
            return self._isolated()
        return _FREE if self._door.is_set() else self._after_door()

    @contextlib.asynccontextmanager
    async def _after_door(self) -> AsyncIterator[None]:
        await self._door.wait()
        yield

    @contextlib.asynccontextmanager
    async def _isolated(self) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self._probation.acquire(), self.hold_timeout_s)
        except TimeoutError:
            m.REQUESTS_FAILED.labels(reason="hold_timeout").inc()
            raise EngineUnavailableError("request waited too long for its probation slot") from None
        self._door.clear()
        reopen: asyncio.TimerHandle | None = None
        try:
            with contextlib.suppress(TimeoutError):  # bounded: then it runs beside what is still inside
                await asyncio.wait_for(self._empty.wait(), self.drain_timeout_s)
            # A non-streaming suspect yields nothing until it ends: bound the door's closing by time too.
            reopen = asyncio.get_running_loop().call_later(self.drain_timeout_s, self._door.set)
            yield
        finally:
            if reopen is not None:
                reopen.cancel()
            self._door.set()
            self._probation.release()
