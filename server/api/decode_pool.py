"""Image normalisation, bounded: a small dedicated thread pool and a budget of pixels in progress.

Normalising an image (:func:`server.api.media.normalized_image`) decodes all its pixels: tens of ms for
a photo, seconds and about 20 bytes a pixel at the largest size allowed. Without a bound, a few
requests of large transparent images took every CPU of the API process and a gigabyte each
(measured: ten 7000x7000 PNGs, 16.8 s and +956 MB for one request, a normal request delayed 55 s).

* Every decode runs on :class:`DecodePool`'s own threads (``--guard-decode-threads``), never on the
  event loop, the default executor that vLLM's serving layer shares, or vLLM's media loading threads
  (an image waiting here holds none of them: :mod:`server.vllm_hooks.media_connector`).
* Every decode first takes its image's pixel count from a budget of pixels decoding at once
  (``--guard-decode-pixels``, at least one largest image), given back when the decode ends. Waiters are
  served in arrival order, so small images cannot starve a large one.

A request whose client goes away while it waits gives its place up; a decode already running finishes
(a thread cannot be stopped) and only then gives its pixels back, so the budget counts what is really
in memory.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from server.metrics import definitions as m

T = TypeVar("T")


class DecodePool:
    """Arguments:
    threads: decoding threads (each decodes one image at a time).
    max_pixels: pixels that may be decoding at once, over all threads; no single job may ask for more.

    Raises:
        ValueError: ``threads`` or ``max_pixels`` below 1.
    """

    def __init__(self, threads: int, max_pixels: int) -> None:
        if threads < 1 or max_pixels < 1:
            raise ValueError(f"a decode pool needs at least one thread and one pixel, not {threads}, {max_pixels}")
        self.max_pixels = max_pixels
        self.free = max_pixels
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vlguard-decode")

    async def run(self, pixels: int, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on a decoding thread once ``pixels`` are free in the budget.

        Arguments:
            pixels: the job's cost (an image's ``width x height``); clamped to the budget, so a job the
                media policy admitted always runs, alone if need be.

        Raises:
            whatever ``fn`` raises; ``asyncio.CancelledError`` when cancelled (waiting or running).
        """
        cost = min(max(pixels, 0), self.max_pixels)
        await self._acquire(cost)
        loop = asyncio.get_running_loop()
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            self._release(cost)
            raise
        m.DECODE_PIXELS.set(self.max_pixels - self.free)
        # The pixels come back when the thread is done with them, even if this caller is cancelled first.
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release, cost))
        return await asyncio.wrap_future(job)

    def shutdown(self) -> None:
        """Stop the threads once their current jobs end (queued jobs are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _acquire(self, cost: int) -> None:
        if not self._waiters and self.free >= cost:
            self.free -= cost
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (cost, granted)
        self._waiters.append(entry)
        m.DECODE_WAITING.set(len(self._waiters))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted just as it was cancelled: give it back
                self._release(cost)
            else:
                self._waiters.remove(entry)
                self._grant()  # a large waiter leaving may let smaller ones behind it in
            raise
        finally:
            m.DECODE_WAITING.set(len(self._waiters))

    def _release(self, cost: int) -> None:
        self.free += cost
        self._grant()
        m.DECODE_PIXELS.set(self.max_pixels - self.free)

    def _grant(self) -> None:
        while self._waiters and self.free >= self._waiters[0][0]:
            cost, granted = self._waiters.popleft()
            self.free -= cost
            granted.set_result(None)
