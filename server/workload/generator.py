"""The two-pass load generator behind ``vlguard bench twopass``.

A :class:`TwoPassPlan` turns a seed into an endless, reproducible sequence of *pairs*: one image (a
bundled scikit-image photograph or a file from a folder, cropped a little, scaled to one of the
configured sizes and stamped with the pair's number so no two pairs share an image) sent first with
the primary prompt, then with the longer rescue prompt (the primary turn unchanged plus a follow-up
turn; :mod:`server.workload.twopass`). Pair ``i`` is the same for every system and run with the same
seed, so compared systems see identical traffic.

:func:`run` drives a server through the official ``openai`` client: ``concurrency`` pairs in flight,
each pair's rescue sent after its primary answered (like the users' pipeline), a seeded share of the
requests streamed (time to first token measured on those), until ``pairs`` pairs ran or ``duration_s``
elapsed. Every request becomes a :class:`Record`; failures are recorded by kind, never raised.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from tqdm import tqdm

from server.workload import phase_trace
from server.workload.images import PHOTOS, data_uri, folder_images, photo_bytes, resized_png
from server.workload.twopass import PRIMARY_PROMPT, RESCUE_PROMPT, primary_messages, rescue_messages

#: Words the prompt padding is drawn from (plain English: about one token each on large tokenizers).
WORDS = (
    "worker helmet vest ladder forklift spill exit door smoke fire cable crane scaffold gate zone badge "
    "camera frame shift night morning floor stairs guard rail light alarm sign hazard report area loading "
    "dock truck pallet box shelf aisle window glove boot mask noise dust water leak valve pipe tank"
).split()


@dataclass(frozen=True)
class TwoPassConfig:
    """What :func:`run` sends. Sizes are pixels (longest image side); prompt lengths are extra words."""

    seed: int = 0
    image_sizes: tuple[int, ...] = (224, 336, 448)
    primary_words: int = 40
    rescue_words: int = 120
    max_tokens: int = 16
    stream_share: float = 0.5
    image_dir: Path | None = None


@dataclass(frozen=True)
class Pair:
    """One image's two passes. ``image`` is the PNG both passes carry (same bytes)."""

    index: int
    image_name: str
    image_side: int
    image: bytes
    primary: list[dict[str, Any]]
    rescue: list[dict[str, Any]]
    stream: tuple[bool, bool]


class TwoPassPlan:
    """Pair ``i`` of the workload for one :class:`TwoPassConfig` (deterministic in ``seed`` and ``i``)."""

    def __init__(self, config: TwoPassConfig) -> None:
        self.config = config
        if config.image_dir is not None:
            self._sources = folder_images(config.image_dir)
        else:
            self._sources = {name: photo_bytes(name) for name in PHOTOS}
        self._names = sorted(self._sources)

    def pair(self, index: int) -> Pair:
        cfg = self.config
        rng = random.Random(cfg.seed * 1_000_003 + index)
        name = rng.choice(self._names)
        side = rng.choice(cfg.image_sizes)
        image = resized_png(self._sources[name], side, crop=rng.randrange(16), stamp=index % (1 << 24))
        uri = data_uri(image, "image/png")
        primary = PRIMARY_PROMPT + " Site notes: " + " ".join(rng.choices(WORDS, k=cfg.primary_words))
        rescue = RESCUE_PROMPT + " Also consider: " + " ".join(rng.choices(WORDS, k=cfg.rescue_words))
        stream = (rng.random() < cfg.stream_share, rng.random() < cfg.stream_share)
        return Pair(
            index, name, side, image, primary_messages(uri, primary), rescue_messages(uri, primary, rescue), stream
        )


@dataclass
class Record:
    """One request's outcome. Times are seconds; ``start_s`` counts from the run's start."""

    pair: int
    kind: str  # "primary" or "rescue"
    stream: bool
    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    ok: bool = False
    error: str | None = None  # None, "http_<status>", "connection", "timeout", "stream_error" or a type
    prompt_tokens: int = 0
    completion_tokens: int = 0
    trace_id: str | None = None  # sent as X-Request-Id (see server.workload.phase_trace)
    sent_at: float = 0.0  # time.monotonic() when the request was sent (one clock with the servers' traces)


@dataclass
class RunResult:
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    started_at: float = 0.0  # time.monotonic() at the run's start


def error_kind(exc: BaseException) -> str:
    """A short, stable name for a failed request's exception (used as a table column)."""
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, openai.APIError):
        return "stream_error"  # an error event inside a 200 stream
    return type(exc).__name__


async def _request(
    client: openai.AsyncOpenAI, model: str, messages: list[dict[str, Any]], stream: bool, max_tokens: int, rec: Record
) -> None:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    extra = {"ignore_eos": True}  # fixed output length: comparable work per request
    headers = {"X-Request-Id": rec.trace_id} if rec.trace_id else None
    started = rec.sent_at = time.monotonic()
    try:
        if stream:
            chunks = await client.chat.completions.create(
                **body, stream=True, stream_options={"include_usage": True}, extra_body=extra, extra_headers=headers
            )
            async for chunk in chunks:
                if rec.ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
                    rec.ttft_s = time.monotonic() - started
                if chunk.usage is not None:
                    rec.prompt_tokens, rec.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        else:
            resp = await client.chat.completions.create(**body, extra_body=extra, extra_headers=headers)
            if resp.usage is not None:
                rec.prompt_tokens, rec.completion_tokens = resp.usage.prompt_tokens, resp.usage.completion_tokens
        rec.ok = True
    except Exception as exc:  # every failure is data here
        rec.error = error_kind(exc)
    rec.e2e_s = time.monotonic() - started


async def run(
    base_url: str,
    plan: TwoPassPlan,
    *,
    pairs: int | None = None,
    duration_s: float | None = None,
    concurrency: int = 4,
    first_pair: int = 0,
    model: str | None = None,
    api_key: str = "unused",
    timeout_s: float = 600.0,
    progress: bool = True,
    on_record: Callable[[Record], None] | None = None,
    trace: bool = False,
) -> RunResult:
    """Send pairs ``first_pair, first_pair + 1, ...`` to the server at ``base_url`` (``http://host:port``).

    Stops starting pairs after ``pairs`` of them or ``duration_s`` seconds (at least one must be given);
    pairs in flight finish. ``on_record`` is called with each finished request (e.g. to kill the engine
    after N successes). With ``trace``, each request carries an ``X-Request-Id`` the servers' phase
    tracer recognises (:mod:`server.workload.phase_trace`). Raises ``ValueError`` when neither bound is given.
    """
    if pairs is None and duration_s is None:
        raise ValueError("give pairs or duration_s")
    end = first_pair + pairs if pairs is not None else None
    # Images are encoded before the clock starts when the count is known (PIL work is not the server's).
    ready = {i: plan.pair(i) for i in range(first_pair, end)} if end is not None else {}
    next_index = first_pair
    result = RunResult()
    bar = tqdm(total=2 * pairs if pairs else None, unit="req", disable=not progress, leave=False)
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s
    ) as client:
        served = model or (await client.models.list()).data[0].id
        result.started_at = time.monotonic()

        async def worker() -> None:
            nonlocal next_index
            while True:
                elapsed = time.monotonic() - result.started_at
                if (end is not None and next_index >= end) or (duration_s is not None and elapsed >= duration_s):
                    return
                pair = ready.pop(next_index, None) or plan.pair(next_index)
                next_index += 1
                for kind, messages, stream in (
                    ("primary", pair.primary, pair.stream[0]),
                    ("rescue", pair.rescue, pair.stream[1]),
                ):
                    rec = Record(pair.index, kind, stream, time.monotonic() - result.started_at, 0.0)
                    rec.trace_id = phase_trace.trace_id() if trace else None
                    await _request(client, served, messages, stream, plan.config.max_tokens, rec)
                    result.records.append(rec)
                    bar.update(1)
                    if on_record is not None:
                        on_record(rec)
                    if rec.error == "connection":  # the server is down (restarting): do not spin
                        await asyncio.sleep(0.5)
                        break

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()
    result.wall_s = time.monotonic() - result.started_at
    return result
