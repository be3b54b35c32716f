"""The load generator of ``--scenario overload``: image chats at a fixed rate (open loop) or from a fixed
number of callers (closed loop), run as its own process so it can hold real-time priority (``chrt -f``).

Each request is one non-streamed chat on a new image (pair ``first + i`` of the two-pass workload's primary
prompt: no two requests share an image, so the prefix cache serves none of them) with ``max_tokens`` output
tokens, EOS ignored. Its caller gives up after ``timeout`` seconds, closing the connection as real callers'
SDKs do, and says so in ``X-Request-Timeout`` (stock vLLM ignores the header). Open loop: request ``i`` is
sent at ``i / rate`` seconds whatever came back. Closed loop: ``callers`` callers send back to back until
``duration`` seconds have passed or ``callers`` x ``duration`` requests went out (one a second per caller).
The bodies are built before the clock starts either way: built meanwhile, the images took the cores the
server needs (a closed loop then measured a third of the capacity an open loop found).

Writes one JSON object: ``rate_sent`` (requests over the span of their sends, per second), ``lag_max_s``
(how far behind its schedule a send went out), ``span_s`` (from the first send until the last one ended or
``duration``, whichever is later) and ``requests``: ``[sent_s, status, seconds, tokens]``
each, status 0 where the caller gave up or got no answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from server.workload.generator import TwoPassConfig, TwoPassPlan

GAVE_UP = 0


def body(plan: TwoPassPlan, index: int, model: str) -> bytes:
    """The request body of pair ``index``'s primary chat (JSON bytes)."""
    chat = {
        "model": model,
        "messages": plan.pair(index).primary,
        "max_tokens": plan.config.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return json.dumps(chat).encode()


async def _send(client: httpx.AsyncClient, data: bytes, timeout_s: float, t0: float) -> list[float]:
    sent = time.monotonic()
    status, tokens = GAVE_UP, 0
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post("/v1/chat/completions", content=data)
            status = resp.status_code
            if status == 200:
                tokens = resp.json()["usage"]["completion_tokens"]
    except (TimeoutError, httpx.HTTPError):
        status = GAVE_UP
    return [sent - t0, status, time.monotonic() - sent, tokens]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = TwoPassPlan(TwoPassConfig(seed=args.seed, image_sizes=args.image_sizes, max_tokens=args.max_tokens))
    headers = {"Content-Type": "application/json", "X-Request-Timeout": f"{args.timeout:g}"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits, timeout=None) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        count = round(args.rate * args.duration) if args.rate else round(args.callers * args.duration)
        bodies = [body(plan, args.first + i, model) for i in range(count)]
        if args.rate:
            t0 = time.monotonic()
            tasks, lag = [], 0.0
            for i, data in enumerate(bodies):
                delay = t0 + i / args.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                lag = max(lag, -delay)
                tasks.append(asyncio.create_task(_send(client, data, args.timeout, t0)))
            records = await asyncio.gather(*tasks)
        else:
            t0, lag, records, left = time.monotonic(), 0.0, [], iter(bodies)

            async def caller() -> None:
                while time.monotonic() - t0 < args.duration and (data := next(left, None)) is not None:
                    records.append(await _send(client, data, args.timeout, t0))

            await asyncio.gather(*(caller() for _ in range(args.callers)))
    sends = sorted(r[0] for r in records)
    span = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    end = max([args.duration, *(r[0] + r[2] for r in records)])
    rate = (len(sends) - 1) / span if span else 0.0
    return {"rate_sent": rate, "lag_max_s": lag, "span_s": end, "requests": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.workload.flood", description=__doc__.split("\n")[0])
    parser.add_argument("url")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="requests per second, open loop")
    load.add_argument("--callers", type=int, help="callers in a closed loop")
    parser.add_argument("--duration", type=float, required=True, help="seconds of sending")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds a caller waits (default 15)")
    parser.add_argument("--max-tokens", type=int, default=512, help="output tokens per request (default 512)")
    parser.add_argument("--image-sizes", type=lambda s: tuple(map(int, s.split(","))), default=(224, 336, 448))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="index of the first pair (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
