"""Prometheus multiprocess mode: the shared directory and the per-scrape registry.

vLLM's API process, its engine-core process and its workers all write metrics; prometheus-client's
multiprocess mode lets ``/metrics`` in the API process aggregate them. The directory must be set
before ``prometheus_client`` is first imported anywhere in the process (it picks its value class at
import), and wiped at start so a previous run's series do not leak in.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from server import run_dirs

ENV = "PROMETHEUS_MULTIPROC_DIR"
logger = logging.getLogger(__name__)


def prepare_multiprocess_dir() -> Path:
    """Set (or reuse) ``PROMETHEUS_MULTIPROC_DIR`` and wipe it.

    A directory given in the environment is created if missing and emptied of ``*.db`` files;
    otherwise a private folder is made in the temp folder (:func:`server.run_dirs.make`: removed however the
    server ends).

    Returns:
        The directory, now empty of metric files.
    """
    if "prometheus_client" in sys.modules:
        logger.warning("prometheus_client was imported before %s was set; metrics may be incomplete", ENV)
    given = os.environ.get(ENV)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for db in path.glob("*.db"):
            db.unlink()
    else:
        path = run_dirs.make("metrics")
        os.environ[ENV] = str(path)
    return path


def render_latest() -> tuple[bytes, str]:
    """Render every process's metrics in the Prometheus text format (the files of processes that are gone
    folded into the archive first: :mod:`server.metrics.archive`).

    Uses a fresh registry with a ``MultiProcessCollector`` per call when the multiprocess directory is
    set (the normal case under ``vlguard serve``), or the process's default registry otherwise.

    Returns:
        ``(body, content_type)``.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from server.metrics import archive

    if path := os.environ.get(ENV):
        archive.archive_dead(path)  # a process that died since the last teardown (a spare, a slow worker)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        with archive.reading(path):
            return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def archive_dead_processes() -> int:
    """Fold the metric files of every process that is gone (engine cores and workers that died or were
    replaced) into the archive (:mod:`server.metrics.archive`); how many files were folded or dropped."""
    from server.metrics import archive

    path = os.environ.get(ENV)
    return archive.archive_dead(path) if path else 0
