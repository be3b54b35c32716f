"""server.metrics.archive on prometheus-client's own multiprocess files: what processes that are gone wrote is
folded into one archive per kind, and the collector reads every total as before, from fewer files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from server.metrics import archive

WRITER = """
import os, sys
from prometheus_client import Counter, Gauge, Histogram
n = int(sys.argv[1])
Counter("jobs", "", ["kind"]).labels(kind="a").inc(n)
Histogram("took_seconds", "", buckets=(1, 10)).observe(n)
Gauge("peak", "", multiprocess_mode="max").set(n)
Gauge("latest", "", multiprocess_mode="mostrecent").set(n)
Gauge("live", "", multiprocess_mode="livesum").set(n)
Gauge("each", "").set(n)
print(os.getpid())
"""


def _write(folder: Path, n: int) -> int:
    """A process that writes its metrics and exits; its pid."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    proc = subprocess.run([sys.executable, "-c", WRITER, str(n)], env=env, check=True, capture_output=True, text=True)
    return int(proc.stdout)


def _collect(folder: Path) -> dict[str, float]:
    code = (
        "from prometheus_client import CollectorRegistry, multiprocess\n"
        "r = CollectorRegistry(); multiprocess.MultiProcessCollector(r)\n"
        "print(repr({s.name + str(sorted(s.labels.items())): s.value for m in r.collect() for s in m.samples}))"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return eval(out.stdout)


def test_dead_processes_fold_into_one_archive_per_kind_and_every_total_stays(tmp_path: Path) -> None:
    pids = [_write(tmp_path, n) for n in (2, 5)]
    assert archive.archive_dead(tmp_path, alive=lambda pid: pid != pids[0]) == 6  # the first one's six files
    once = _collect(tmp_path)
    pids.append(_write(tmp_path, 3))
    before = _collect(tmp_path)
    assert before["jobs_total[('kind', 'a')]"] == 10 and before["took_seconds_count[]"] == 3
    assert archive.archive_dead(tmp_path, alive=lambda pid: False) == 12
    after = _collect(tmp_path)
    assert {k: v for k, v in before.items() if "pid" not in k and "live" not in k} == {
        k: v for k, v in after.items() if "pid" not in k
    }  # counters, histograms, max and most recent gauges as they were
    assert after["peak[]"] == 5 and after["latest[]"] == 3 and after["took_seconds_bucket[('le', '1.0')]"] == 0
    assert once["jobs_total[('kind', 'a')]"] == 7
    assert sorted(f.name for f in tmp_path.glob("*.db")) == [
        "counter_archive.db", "gauge_max_archive.db", "gauge_mostrecent_archive.db", "histogram_archive.db"
    ]  # fmt: skip
    assert archive.archive_dead(tmp_path, alive=lambda pid: False) == 0  # the archive is no process's
