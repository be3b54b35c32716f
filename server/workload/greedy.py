"""Greedy outputs of a server (token ids and logprobs), for comparing engines token by token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai import OpenAI


@dataclass(frozen=True)
class Greedy:
    """Token ids and their logprobs (natural log) of one greedy completion."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def max_logprob_diff(self, other: Greedy) -> float:
        """Largest |logprob difference| over the positions both have (the token ids may differ)."""
        return max((abs(x - y) for x, y in zip(self.logprobs, other.logprobs, strict=False)), default=0.0)

    def agreeing_tokens(self, other: Greedy) -> int:
        """How many leading token ids are equal."""
        n = 0
        for x, y in zip(self.token_ids, other.token_ids, strict=False):
            if x != y:
                break
            n += 1
        return n


def greedy(client: OpenAI, model: str, messages: list[dict[str, Any]], max_tokens: int = 6) -> Greedy:
    """Greedy chat completion with logprobs, tokens reported as ids (``return_tokens_as_token_ids``),
    EOS ignored so every run yields ``max_tokens`` tokens."""
    resp = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    if content is None:
        raise ValueError("the server returned no logprobs")
    return Greedy(
        token_ids=tuple(int(t.token.removeprefix("token_id:")) for t in content),
        logprobs=tuple(t.logprob for t in content),
    )
