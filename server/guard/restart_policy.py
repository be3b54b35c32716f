"""The restart policy (API process): how many rebuilds a window allows, and how long to wait after a
failed one. The supervisor (:mod:`server.guard.supervisor`) asks; nothing here builds or waits."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from server.metrics import definitions as m
from server.settings import GuardSettings

logger = logging.getLogger("server.guard.supervisor")


class RestartBudget:
    """At most ``max_restarts`` counted rebuilds within a sliding ``window_s`` seconds.

    Arguments:
        clock: monotonic seconds.
    """

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float]) -> None:
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._restarts: collections.deque[float] = collections.deque()

    def spent(self) -> bool:
        """Whether the budget is spent now (old restarts leave the window first)."""
        now = self.clock()
        while self._restarts and now - self._restarts[0] > self.window_s:
            self._restarts.popleft()
        return len(self._restarts) >= self.max_restarts

    def spend(self) -> None:
        """Count a restart (attempt) now."""
        self._restarts.append(self.clock())

    def __len__(self) -> int:
        return len(self._restarts)


class RestartPolicy:
    """Whether one more rebuild attempt may start, and the backoff after failed ones.

    Arguments:
        settings: ``restart_max`` within ``restart_window`` seconds; ``restart_backoff`` seconds, doubling
            with each failed attempt in a row.
        clock: monotonic seconds.
    """

    def __init__(self, settings: GuardSettings, clock: Callable[[], float]) -> None:
        self.budget = RestartBudget(settings.restart_max, settings.restart_window, clock)
        self.backoff_s = settings.restart_backoff
        m.RESTART_BUDGET.set(settings.restart_max)

    def may_attempt(self, counted: bool, failures: int) -> bool:
        """Whether a rebuild attempt may start now; it is then counted when the death that asked for it
        spends the budget (``counted``: a fault charged to one request does not) or an attempt already
        failed (then the engine, not a request, is at fault).

        Arguments:
            failures: attempts that failed since the death.
        """
        if self.budget.spent():
            return False
        if counted or failures:
            self.budget.spend()
        return True

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed attempt in a row (exponential)."""
        return float(self.backoff_s * 2 ** (failures - 1))

    def failed(self, failures: int) -> None:
        """A rebuild attempt failed (the ``failures``-th in a row): counted and logged with its traceback
        (call it from the ``except`` block)."""
        m.ENGINE_RESTARTS.labels(outcome="failure").inc()
        logger.exception("engine restart attempt failed (%d)", failures)

    def succeeded(self, took_s: float) -> None:
        """A rebuild made the engine READY ``took_s`` seconds after its death: counted and timed."""
        m.ENGINE_RESTARTS.labels(outcome="success").inc()
        m.RESTART_DURATION.observe(took_s)
        m.ENGINE_RECOVERIES.labels(kind="rebuild").inc()
        m.RECOVERY_DURATION.labels(kind="rebuild").observe(took_s)
