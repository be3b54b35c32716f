"""How long a request waits for an engine that is not READY (API process): the hold timeout, from what a
build really takes on this machine.

A rebuild takes one of three paths, known at the moment of the death (:class:`RebuildPath`): through a
spare engine process that has imported (seconds), through a spare still importing (it has a head start,
but the rest of its imports is on the rebuild's path), or cold (new processes, every import: as long as a
first start, minutes on a GPU). A fixed hold timeout is either too short for a cold rebuild (every held
request fails just before the engine comes back) or far too long for a fast one. :class:`HoldPolicy`
measures each build and holds a request for as long as the path in progress took last time, with margin;
and it bounds a rebuild by the same measure: a rebuild stuck on a stopped or hung process is abandoned
after a few times the last cold build instead of the start-up timeout (half an hour by default).
"""

from __future__ import annotations

import enum

from server.settings import GuardSettings


class RebuildPath(enum.StrEnum):
    """Which way a rebuild starts its engine processes (``vlguard_engine_rebuild_path{path}``)."""

    SPARE = "spare"  # a spare engine core and worker that have imported and warmed up
    SPARE_STARTING = "spare_starting"  # a spare still importing: used, the rest of its imports waited for
    COLD = "cold"  # no spare (off, dead, or vLLM forks): processes spawned and imported as vLLM would


class HoldPolicy:
    """The hold timeout for a request that arrives, or is carried over, while the engine is not READY.

    With an operator's bound (``--guard-hold-timeout S``) that bound, always. Without one (the default):

    - first start: ``startup_timeout`` (the start's own bound: nothing measured yet);
    - a rebuild through a ready spare: ``floor_s`` or ``margin`` x the last rebuild that took that path,
      whichever is longer;
    - a rebuild through a spare still importing, or cold: ``floor_s`` or ``margin`` x the last cold build
      plus ``slack_s``, whichever is longer; the last cold build is the first start until a cold rebuild
      is measured (a spare still importing is never slower than cold: it has a head start);
    - never longer than ``startup_timeout`` (a build that takes longer fails anyway).

    :meth:`build_limit` bounds one build: the first start by ``startup_timeout``, a rebuild by
    ``rebuild_s`` (``--guard-rebuild-timeout``) or else 3x the last cold build, at least ``rebuild_floor_s``,
    at most ``startup_timeout``.

    Arguments:
        operator_s: ``--guard-hold-timeout`` in seconds, or None (measured, as above).
        startup_timeout_s: ``--guard-startup-timeout``: the bound of one build, in seconds.
        floor_s: the shortest hold, seconds (what a client waits for a fast rebuild at least).
        margin: factor on the measured duration; ``slack_s``: seconds added on the cold paths (load varies).
    """

    def __init__(
        self,
        operator_s: float | None,
        startup_timeout_s: float,
        floor_s: float = 120.0,
        margin: float = 1.5,
        slack_s: float = 30.0,
        rebuild_s: float | None = None,
        rebuild_floor_s: float = 300.0,
    ) -> None:
        self.operator_s, self.startup_timeout_s = operator_s, startup_timeout_s
        self.floor_s, self.margin, self.slack_s = floor_s, margin, slack_s
        self.rebuild_s, self.rebuild_floor_s = rebuild_s, rebuild_floor_s
        self._last: dict[RebuildPath, float] = {}  # seconds the last build on each path took

    @classmethod
    def from_settings(cls, settings: GuardSettings) -> HoldPolicy:
        """The policy of ``--guard-hold-timeout``, ``--guard-startup-timeout`` and ``--guard-rebuild-timeout``."""
        return cls(settings.hold_timeout, settings.startup_timeout, rebuild_s=settings.rebuild_timeout)

    @property
    def base_s(self) -> float:
        """The hold when nothing else is known: the operator's bound, else ``floor_s``."""
        return self.operator_s if self.operator_s is not None else self.floor_s

    def measured(self, path: RebuildPath, seconds: float) -> None:
        """A build on ``path`` took ``seconds`` (from the death, or from the start, to READY)."""
        self._last[path] = seconds

    def last(self, path: RebuildPath) -> float | None:
        """Seconds the last build on ``path`` took, or None."""
        return self._last.get(path)

    def limit(self, path: RebuildPath | None) -> float:
        """Seconds a request held now waits at most.

        Arguments:
            path: the path of the rebuild in progress, or None for the first start.
        """
        if self.operator_s is not None:
            return self.operator_s
        if path is None:
            return self.startup_timeout_s
        if path is RebuildPath.SPARE and (fast := self._last.get(RebuildPath.SPARE)) is not None:
            wanted = self.margin * fast
        elif path is RebuildPath.SPARE:
            wanted = 0.0  # nothing measured: the floor
        elif (cold := self._last.get(RebuildPath.COLD)) is not None:
            wanted = self.margin * cold + self.slack_s
        else:
            wanted = self.startup_timeout_s  # a cold rebuild before any build was measured
        return min(self.startup_timeout_s, max(self.floor_s, wanted))

    def build_limit(self, rebuild: bool) -> float:
        """Seconds one build may take: the first start ``startup_timeout``; a rebuild as above."""
        if not rebuild:
            return self.startup_timeout_s
        if self.rebuild_s is not None:
            return self.rebuild_s
        cold = self._last.get(RebuildPath.COLD)
        if cold is None:
            return self.startup_timeout_s
        return min(self.startup_timeout_s, max(self.rebuild_floor_s, 3 * cold))


__all__ = ["HoldPolicy", "RebuildPath"]
