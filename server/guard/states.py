"""The supervised engine's lifecycle states (API process): the current one, its metrics, and waiting on it.

STARTING -> READY -> DEAD -> RESTARTING -> READY, or FAILED when restarts keep failing or the restart budget
is spent; STOPPED before the start and after shutdown. What moves the engine between them is the
supervisor's (:mod:`server.guard.supervisor`); this module only holds the state and wakes its waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable

from server.guard.errors import EngineUnavailableError
from server.metrics import definitions as m


class EngineState(enum.StrEnum):
    """Lifecycle state of the supervised engine."""

    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


#: States a held request stops waiting at: READY to be served, FAILED or STOPPED to be refused.
SETTLED = (EngineState.READY, EngineState.FAILED, EngineState.STOPPED)


class EngineStates:
    """The current :class:`EngineState`; each change sets ``vlguard_engine_state{state}`` and
    ``vlguard_engine_up`` and wakes whoever waits for it."""

    def __init__(self) -> None:
        self.current = EngineState.STOPPED
        self._settled = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) at every change
        self.held = 0  # requests waiting in hold()
        self.set(EngineState.STOPPED)

    def set(self, state: EngineState) -> None:
        """Move to ``state``."""
        self.current = state
        for s in EngineState:
            m.ENGINE_STATE.labels(state=s.value).set(1 if s is state else 0)
        m.ENGINE_UP.set(1 if state is EngineState.READY else 0)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if state in SETTLED:
            self._settled.set()
        else:
            self._settled.clear()

    async def wait_for(self, *states: EngineState) -> EngineState:
        """Wait until the state is one of ``states`` (no timeout: wrap it in one) and return it."""
        while self.current not in states:
            await self._changed.wait()
        return self.current

    async def settled(self) -> None:
        """Wait until the state is one of :data:`SETTLED` (no timeout: wrap it in one)."""
        await self._settled.wait()

    async def hold(self, limit_s: Callable[[], float], max_held: int) -> None:
        """Hold a request until the state settles (:data:`SETTLED`), at most ``limit_s()`` seconds from
        now and ``max_held`` requests at once (``vlguard_requests_held``). The limit is read again at every
        state change and when it runs out: a rebuild found slower than expected holds the request longer.

        Raises:
            EngineUnavailableError: FAILED or STOPPED now, ``max_held`` requests already held, or not
                settled within the limit.
        """
        if self.current in (EngineState.FAILED, EngineState.STOPPED):
            raise EngineUnavailableError(f"engine is {self.current.value}", reason="engine_failed")
        if self.held >= max_held:
            raise EngineUnavailableError("too many requests waiting for the engine", reason="too_many_held")
        self.held += 1
        m.REQUESTS_HELD.set(self.held)
        loop = asyncio.get_running_loop()
        since = loop.time()
        try:
            while not self._settled.is_set():
                limit = limit_s()
                if (remaining := since + limit - loop.time()) <= 0:
                    raise EngineUnavailableError(f"engine not ready within {limit:g} s ({self.current.value})")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)
        finally:
            self.held -= 1
            m.REQUESTS_HELD.set(self.held)
