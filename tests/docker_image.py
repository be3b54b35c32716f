"""vlguard's image for the Docker engine tests, built in the background from the end of collection.

The build (``scripts/standin-base.sh``: the stand-in for the stock base image, kept between runs on a
machine; then ``docker build`` of the repository's Dockerfile on it) takes 3-4 minutes on a fresh machine,
mostly one core and the disk. Started when collection shows the Docker engine tests will run, it
overlaps the unit and in-process API tests instead of adding to the run (as the session servers do).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.servers import REPO


def docker_answers() -> bool:
    """Whether a Docker engine answers (``docker info``)."""
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def tag(vllm_version: str) -> str:
    """The test image's tag for one engine lane."""
    return f"vlguard-test:{vllm_version}"


@dataclass
class ImageBuild:
    """A running (or finished) build of :func:`tag`; its output goes to ``log``."""

    proc: subprocess.Popen[bytes]
    log: Path
    tag: str

    @classmethod
    def start(cls, vllm_version: str, log: Path) -> ImageBuild:
        """Start the stand-in base (cached per lane environment) and the image build on it."""
        image = tag(vllm_version)
        script = (
            "set -euo pipefail; "  # a failed stand-in stops here, with its own error last
            'base=$("$1/scripts/standin-base.sh" "$2" | tail -n 1); '
            'docker build --network host --build-arg "VLLM_IMAGE=$base" -t "$3" "$1"'
        )
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", script, "build", str(REPO), vllm_version, image],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return cls(proc, log, image)

    def wait(self, timeout_s: float = 840) -> str:
        """The image's tag once built (the build is stopped when the wait ends any other way: a timeout,
        Ctrl-C, pytest-timeout's 900 s).

        Raises:
            AssertionError: the build failed (with the end of its output).
            subprocess.TimeoutExpired: it took longer than ``timeout_s`` seconds.
        """
        try:
            rc = self.proc.wait(timeout_s)
        except BaseException:
            self.stop()
            raise
        assert rc == 0, f"image build exited {rc}:\n{self.log.read_text(errors='replace')[-4000:]}"
        return self.tag

    def stop(self) -> None:
        """End an unfinished build (the run stopped before a test used it): SIGTERM to its whole process
        group (the stand-in script then removes its temporary root), SIGKILL to what is left after 30 s."""
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while self._signal_group(0) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def _signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the build's process group; whether any of it was still there."""
        self.proc.poll()  # reap the leader, so that a group of one exited process is gone
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True
