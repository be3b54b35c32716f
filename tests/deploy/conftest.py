"""Fixtures the deployment tests share."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def haproxy_bin() -> str:
    """Debian's haproxy (installed by scripts/system-tools.sh, which `make test` runs)."""
    path = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if path is None:
        pytest.fail("haproxy not found: run scripts/system-tools.sh (make test does)")
    return path
