"""Greedy outputs of a server, for comparing engines token by token."""

from __future__ import annotations

from typing import Any

from server.workload.greedy import Greedy, greedy
from server.workload.images import photo_uri
from server.workload.twopass import primary_messages, rescue_messages

__all__ = ["IMAGE_PROMPTS", "TEXT_PROMPT", "Greedy", "assert_same", "greedy", "two_pass_workload"]


def assert_same(a: Greedy, b: Greedy, tol: float = 1e-4) -> None:
    assert a.token_ids == b.token_ids
    assert a.max_logprob_diff(b) <= tol


TEXT_PROMPT = [{"role": "user", "content": "Describe the safety rules for a construction site."}]
IMAGE_PROMPTS = {name: primary_messages(photo_uri(name)) for name in ("astronaut.png", "rocket.jpg", "camera.png")}


def two_pass_workload() -> list[tuple[str, list[dict[str, Any]]]]:
    """Primary then rescue on each image, the whole sequence twice (so prefix-cache hits leave residuals
    inside the image on the second round). Labels are ``<image>/<pass>/<round>``."""
    work = []
    for rnd in (1, 2):
        for name in ("astronaut.png", "coffee.png", "rocket.jpg", "chelsea.png"):
            uri = photo_uri(name)
            work.append((f"{name}/primary/{rnd}", primary_messages(uri)))
            work.append((f"{name}/rescue/{rnd}", rescue_messages(uri)))
    return work
