"""CUDA-graph capture sizes: which step sizes need padding, and to what.

A step of ``n`` scheduled tokens runs as a captured graph of the smallest capture size ``>= n``; steps
above the largest capture size run eagerly, unpadded. A step "needs no padding" when ``n`` is a capture
size or above the largest one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default CUDA-graph capture sizes up to ``max_size``: ``1, 2, 4``, then every 8 below 256,
    then every 16 (``[1, 2, 4, 8, 16, ..., 248, 256, 272, ...]``)."""
    return [s for s in (1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)) if s <= max_size]


class CaptureSizes:
    """A sorted set of capture sizes (tokens per step)."""

    def __init__(self, sizes: Iterable[int]) -> None:
        self.sizes: list[int] = sorted({int(s) for s in sizes if int(s) > 0})

    def __bool__(self) -> bool:
        return bool(self.sizes)

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def needs_padding(self, num_tokens: int) -> bool:
        """True when a step of ``num_tokens`` would be padded (1 <= n < largest and not a capture size)."""
        if not self.sizes or num_tokens <= 0 or num_tokens > self.largest:
            return False
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] != num_tokens

    def padded(self, num_tokens: int) -> int:
        """The size a step of ``num_tokens`` runs at (itself above the largest capture size)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else num_tokens

    def below(self, num_tokens: int) -> int:
        """The largest capture size ``<= num_tokens`` (0 when there is none)."""
        i = bisect.bisect_right(self.sizes, num_tokens)
        return self.sizes[i - 1] if i else 0
