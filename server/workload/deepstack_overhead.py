"""Per-step cost of the deepstack backport and its metrics, side by side with stock vLLM's methods.

One "step" = write the step's deepstack rows, read them for the forward pass, clear them: the three
calls vLLM makes per step on ``Qwen3VLForConditionalGeneration``. Both implementations run on the same
buffers, interleaved, on steps that stock vLLM can serve (no padding: stock raises on padded reads).
Prints the median per-step time of each and the ratio. Sizes default to Qwen3-VL-30B-A3B (hidden 2048,
3 deepstack levels, 8192-token buffer), on CPU.

Usage: ``python -m server.workload.deepstack_overhead [--tokens 1500] [--repeat 2000]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def _model(cls: type, levels: int, capacity: int, hidden: int) -> Any:
    from types import SimpleNamespace

    m: Any = object.__new__(cls)
    torch.nn.Module.__init__(m)
    m.deepstack_num_level = levels
    m.deepstack_input_embeds = [torch.zeros(capacity, hidden, dtype=torch.bfloat16) for _ in range(levels)]
    m.deepstack_input_embeds_num_tokens = 0
    m.config = SimpleNamespace(text_config=SimpleNamespace(hidden_size=hidden))
    embed = SimpleNamespace(weight=torch.zeros(1, hidden, dtype=torch.bfloat16))
    object.__setattr__(m, "language_model", SimpleNamespace(model=SimpleNamespace(embed_tokens=embed)))
    return m


def _step(get: Callable[..., Any], set_: Callable[..., Any], clear: Callable[..., Any], m: Any,
          rows: torch.Tensor) -> float:  # fmt: skip
    n = rows.size(1)
    start = time.perf_counter_ns()
    set_(m, rows)
    get(m, n)
    clear(m, n)
    return (time.perf_counter_ns() - start) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500, help="rows written per step (image tokens)")
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="vlguard-bench-"))

    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as cls

    from server.patches import deepstack

    stock = (cls._get_deepstack_input_embeds, cls._set_deepstack_input_embeds, cls._clear_deepstack_input_embeds)
    patched = (deepstack.get_deepstack_input_embeds, deepstack.set_deepstack_input_embeds,
               deepstack.clear_deepstack_input_embeds)  # fmt: skip
    m = _model(cls, args.levels, args.capacity, args.hidden)
    rows = torch.randn(args.levels, args.tokens, args.hidden).to(torch.bfloat16)
    times: dict[str, list[float]] = {"stock": [], "patched": []}
    for _ in range(50):  # warm-up (first patched read settles device/dtype; metrics files get created)
        _step(*stock, m, rows)
        _step(*patched, m, rows)
    for _ in range(args.repeat):
        times["stock"].append(_step(*stock, m, rows))
        times["patched"].append(_step(*patched, m, rows))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"per step (write {args.tokens} rows x {args.levels} levels x {args.hidden}, read, clear), median of "
        f"{args.repeat}: stock {med['stock']:.1f} us, patched+metrics {med['patched']:.1f} us, "
        f"ratio {med['patched'] / med['stock']:.3f}, difference {med['patched'] - med['stock']:+.1f} us"
    )


if __name__ == "__main__":
    main()
