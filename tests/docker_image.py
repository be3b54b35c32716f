"""vlguard's image for the Docker engine tests, built in the background from the end of collection.

The build (``scripts/standin-base.sh``: the stand-in for the stock base image, kept between runs on a
machine; then ``docker build`` of the repository's Dockerfile on it) takes 3-4 minutes on a fresh machine,
mostly one core and the disk. Started when collection shows the Docker engine tests will run, it
overlaps the unit and in-process API tests instead of adding to the run (as the session servers do).
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.servers import REPO


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
            'base=$("$1/scripts/standin-base.sh" "$2" | tail -n 1) && '
            'docker build --network host --build-arg "VLLM_IMAGE=$base" -t "$3" "$1"'
        )
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", script, "build", str(REPO), vllm_version, image],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return cls(proc, log, image)

    def wait(self, timeout_s: float = 1800) -> str:
        """The image's tag once built.

        Raises:
            AssertionError: the build failed (with the end of its output).
            subprocess.TimeoutExpired: it took longer than ``timeout_s`` seconds.
        """
        rc = self.proc.wait(timeout_s)
        assert rc == 0, f"image build exited {rc}:\n{self.log.read_text(errors='replace')[-4000:]}"
        return self.tag

    def stop(self) -> None:
        """End an unfinished build (the run stopped before a test used it): SIGTERM to its process group
        (the stand-in script then removes its temporary root), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
