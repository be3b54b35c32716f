"""Greedy outputs of a server, for comparing engines token by token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai import OpenAI

from server.workload.images import photo_uri
from server.workload.twopass import primary_messages, rescue_messages


@dataclass(frozen=True)
class Greedy:
    """Token ids and their logprobs of one greedy completion."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


def greedy(client: OpenAI, model: str, messages: list[dict[str, Any]], max_tokens: int = 6) -> Greedy:
    """Greedy chat completion with logprobs, tokens reported as ids (``return_tokens_as_token_ids``)."""
    resp = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    return Greedy(
        token_ids=tuple(int(t.token.removeprefix("token_id:")) for t in content),
        logprobs=tuple(t.logprob for t in content),
    )


def assert_same(a: Greedy, b: Greedy, tol: float = 1e-4) -> None:
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= tol


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
