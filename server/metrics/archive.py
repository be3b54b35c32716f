"""The Prometheus multiprocess folder kept bounded: the files of processes that are gone merged into one
archive per kind.

prometheus-client writes one file per process and metric kind (``counter_<pid>.db``, ``gauge_max_<pid>.db``)
and keeps a dead process's files so that its counters stay in the totals; each rebuilt engine (an engine core,
its worker, a spare) adds files that ``/metrics`` reads on every scrape for as long as the server lives.
:func:`archive_dead` folds them into ``<kind>_archive.db``, one per kind, by the kind's own rule (counters and
histograms: summed, so every total stays monotonic; ``sum``/``max``/``min``/``mostrecent`` gauges: as the
collector combines them). A dead process's ``all`` and ``live*`` gauges are dropped: it has no current value.
Scrapes (:func:`reading`) and the archiving exclude each other through a lock file in the folder, across
the API processes, so no scrape sees a value twice or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
from prometheus_client.mmap_dict import MmapedDict

LOCK = ".archive.lock"
_FILE = re.compile(r"^(counter|histogram|gauge_[a-z]+)_(\d+)\.db$")
#: How a kind's values from several processes combine into one (the collector's own rules).
_COMBINE: dict[str, Callable[[tuple[float, float], tuple[float, float]], tuple[float, float]]] = {
    "counter": lambda a, b: (a[0] + b[0], 0.0),
    "histogram": lambda a, b: (a[0] + b[0], 0.0),
    "gauge_sum": lambda a, b: (a[0] + b[0], 0.0),
    "gauge_max": max,
    "gauge_min": min,
    "gauge_mostrecent": lambda a, b: max(a, b, key=lambda value: value[1]),
}


@contextlib.contextmanager
def _locked(path: Path, mode: int) -> Iterator[None]:
    with open(path / LOCK, "a") as lock:
        fcntl.flock(lock, mode)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def reading(path: str | Path) -> contextlib.AbstractContextManager[None]:
    """Hold while a scrape reads the folder's files: no archiving meanwhile."""
    return _locked(Path(path), fcntl.LOCK_SH)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not: it writes nothing more)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def archive_dead(path: str | Path, alive: Callable[[int], bool] = running) -> int:
    """Fold the files of every process in ``path`` that ``alive`` says is gone into the archive.

    Returns:
        How many files were folded in or dropped.
    """
    path = Path(path)
    dead: dict[str, list[Path]] = {}
    seen: dict[int, bool] = {}  # each process asked once (five files each)
    for file in path.glob("*.db"):
        if (match := _FILE.match(file.name)) is None:
            continue
        if (pid := int(match[2])) not in seen:
            seen[pid] = alive(pid)
        if not seen[pid]:
            dead.setdefault(match[1], []).append(file)
    if not dead:
        return 0
    with _locked(path, fcntl.LOCK_EX):
        for kind, files in dead.items():
            if (combine := _COMBINE.get(kind)) is not None:
                _fold(path / f"{kind}_archive.db", files, combine)
            for file in files:
                file.unlink(missing_ok=True)
    return sum(map(len, dead.values()))


def _fold(
    archive: Path,
    files: list[Path],
    combine: Callable[[tuple[float, float], tuple[float, float]], tuple[float, float]],
) -> None:
    """Write ``archive`` anew (beside it, then renamed over it) with its values and those of ``files``."""
    values: dict[str, tuple[float, float]] = {}
    for file in [archive, *files] if archive.exists() else files:
        for key, value, timestamp, _ in _read(file):
            values[key] = combine(values[key], (value, timestamp)) if key in values else (value, timestamp)
    fresh = archive.with_suffix(".new")
    fresh.unlink(missing_ok=True)
    out = MmapedDict(str(fresh))
    try:
        for key, (value, timestamp) in values.items():
            out.write_value(key, value, timestamp)
    finally:
        out.close()
    os.replace(fresh, archive)


def _read(file: Path) -> list[tuple[str, float, float, int]]:
    try:
        return list(MmapedDict.read_all_values_from_file(str(file)))
    except FileNotFoundError:
        return []
