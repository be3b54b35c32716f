"""Prometheus multiprocess mode: the shared directory and the per-scrape registry.

vLLM's API process, its engine-core process and its workers all write metrics; prometheus-client's
multiprocess mode lets ``/metrics`` in the API process aggregate them. The directory must be set
before ``prometheus_client`` is first imported anywhere in the process (it picks its value class at
import), and wiped at start so a previous run's series do not leak in.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"
logger = logging.getLogger(__name__)


def prepare_multiprocess_dir() -> Path:
    """Set (or reuse) ``PROMETHEUS_MULTIPROC_DIR`` and wipe it.

    A directory given in the environment is created if missing and emptied of ``*.db`` files;
    otherwise a private temporary directory is made and removed at exit.

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
        path = Path(tempfile.mkdtemp(prefix="vlguard-metrics-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ[ENV] = str(path)
    return path


def render_latest() -> tuple[bytes, str]:
    """Render every process's metrics in the Prometheus text format.

    Uses a fresh registry with a ``MultiProcessCollector`` per call when the multiprocess directory is
    set (the normal case under ``vlguard serve``), or the process's default registry otherwise.

    Returns:
        ``(body, content_type)``.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    if os.environ.get(ENV):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    """Drop the live-gauge files of a process that exited (an engine core that died or was replaced)."""
    from prometheus_client import multiprocess

    if os.environ.get(ENV):
        multiprocess.mark_process_dead(pid)
