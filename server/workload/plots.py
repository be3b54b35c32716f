"""PNG charts of benchmark runs (matplotlib, headless ``Agg`` backend).

- :func:`latency_plot`: empirical CDFs of TTFT and end-to-end latency, one line per system.
- :func:`timeline_plot`: a kill-and-recover timeline: successful requests per second and errors per
  second for each system, time measured from the engine kill (at 0).
- :func:`goodput_plot`: goodput and wasted tokens against offered load (``--scenario overload``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

from server.workload.generator import Record


def _cdf(ax: plt.Axes, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(values_ms)
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label} (n={len(xs)})")


def latency_plot(runs: dict[str, list[Record]], path: Path, title: str = "") -> Path:
    """CDFs of TTFT (streamed requests) and e2e latency (successful requests) per system; writes ``path``."""
    fig, (ttft, e2e) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, records in runs.items():
        _cdf(ttft, [r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None], name)
        _cdf(e2e, [r.e2e_s * 1000 for r in records if r.ok], name)
    for ax, what in ((ttft, "time to first token"), (e2e, "end-to-end latency")):
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title or "latency distributions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_plot(runs: dict[str, tuple[list[Record], float]], path: Path, bin_s: float = 1.0) -> Path:
    """Requests finished per second (successes up, errors down) per system around the kill.

    ``runs`` maps a system to (its records, the kill's time in the run's clock, seconds).
    """
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.8 * len(runs)), sharex=True, squeeze=False)
    for ax, (name, (records, kill_s)) in zip(axes[:, 0], runs.items(), strict=True):
        ends = np.array([r.start_s + r.e2e_s - kill_s for r in records])
        ok = np.array([r.ok for r in records], dtype=bool)
        if len(ends):
            edges = np.arange(np.floor(ends.min()), np.ceil(ends.max()) + bin_s, bin_s)
            good, _ = np.histogram(ends[ok], edges)
            bad, _ = np.histogram(ends[~ok], edges)
            ax.bar(edges[:-1], good / bin_s, width=bin_s, align="edge", color="tab:green", label="succeeded")
            ax.bar(edges[:-1], -bad / bin_s, width=bin_s, align="edge", color="tab:red", label="failed")
        ax.axvline(0, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"{name}: engine core killed at t=0", fontsize=10)
        ax.set_ylabel("requests / s")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the kill")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def goodput_plot(systems: dict[str, list[dict[str, float]]], path: Path) -> Path:
    """Goodput (answers in time over the reference capacity) and wasted token share against offered load
    (multiples of that capacity), one line per system, the ideal ``min(load, 1)`` dashed; writes ``path``.
    ``systems`` maps a system to its points (``multiplier``, ``goodput``, ``wasted_share``)."""
    fig, (good, waste) = plt.subplots(1, 2, figsize=(11, 4.2))
    loads = sorted({p["multiplier"] for points in systems.values() for p in points})
    good.plot([0, *loads], [0, *(min(x, 1.0) for x in loads)], "k--", linewidth=1, label="ideal")
    for name, points in systems.items():
        xs = [p["multiplier"] for p in points]
        good.plot(xs, [p["goodput"] for p in points], "o-", label=name)
        waste.plot(xs, [100 * p["wasted_share"] for p in points], "o-", label=name)
    good.set_ylabel("goodput (answered in time / capacity)")
    waste.set_ylabel("tokens generated for callers who had gone (%)")
    for ax in (good, waste):
        ax.set_xlabel("offered load (x capacity)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.suptitle("goodput under overload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
