"""Image normalisation, bounded: a small dedicated thread pool and a budget of pixels in progress.

Normalising an image (:func:`server.api.media.normalized_image`) decodes all its pixels: tens of ms for
a photo, seconds and about 20 bytes a pixel at the largest size allowed. Without a bound, a few
requests of large transparent images took every CPU of the API process and a gigabyte each
(measured: ten 7000x7000 PNGs, 16.8 s and +956 MB for one request, a normal request delayed 55 s).

* Every decode runs on :class:`DecodePool`'s own threads (``--guard-decode-threads``), never on the
  event loop, the default executor that vLLM's serving layer shares, or vLLM's media loading threads
  (an image waiting here holds none of them: :mod:`server.vllm_hooks.media_connector`).
* Every decode first takes its image's pixel count from a budget of pixels decoding at once
  (``--guard-decode-pixels``, at least one largest image), given back when the decode ends.
* Waiters are served one job per client in turn (:func:`server.guard.clients.client_key`), each client's
  own in arrival order: a client that queues many large images delays another client's image by about
  one of its jobs, not by all of them (first come, first served, it waited 27.6 s behind one client's
  twelve 7000x7000 images). The job whose turn it is waits for its pixels, and no one passes it, so small
  images cannot starve a large one.

A request whose client goes away while it waits gives its place up; a decode already running finishes
(a thread cannot be stopped) and only then gives its pixels back, so the budget counts what is really
in memory.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

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
        # client -> its waiting jobs in arrival order; the clients with waiters, in turn order
        self._waiters: dict[str, collections.deque[_Waiter]] = {}
        self._turns: collections.deque[str] = collections.deque()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vlguard-decode")
        m.DECODE_PIXELS.set(0)  # 0, not "no data", until the first image is normalised
        m.DECODE_WAITING.set(0)

    async def run(self, pixels: int, fn: Callable[..., T], *args: object, client: str = "") -> T:
        """Run ``fn(*args)`` on a decoding thread once ``pixels`` are free in the budget and it is the turn
        of ``client`` (:func:`server.guard.clients.client_key`; ``""``: no identity, one queue for all).

        Arguments:
            pixels: the job's cost (an image's ``width x height``); clamped to the budget, so a job the
                media policy admitted always runs, alone if need be.

        Raises:
            whatever ``fn`` raises; ``asyncio.CancelledError`` when cancelled (waiting or running).
        """
        cost = min(max(pixels, 0), self.max_pixels)
        await self._acquire(cost, client)
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

    def waiting(self) -> int:
        """Jobs waiting for their turn or their pixels."""
        return sum(len(queue) for queue in self._waiters.values())

    async def _acquire(self, cost: int, client: str) -> None:
        if not self._turns and self.free >= cost:
            self.free -= cost
            return
        waiter = _Waiter(cost, asyncio.get_running_loop().create_future())
        if client not in self._waiters:
            self._waiters[client] = collections.deque()
            self._turns.append(client)
        self._waiters[client].append(waiter)
        m.DECODE_WAITING.set(self.waiting())
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():  # granted as it was cancelled: give back
                self._release(cost)
            else:
                self._leave(client, waiter)
                self._grant()  # a large waiter leaving may let others in
            raise
        finally:
            m.DECODE_WAITING.set(self.waiting())

    def _leave(self, client: str, waiter: _Waiter) -> None:
        """Take a cancelled ``waiter`` out of its client's queue (a grant may have dropped it already)."""
        queue = self._waiters.get(client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiters[client]
                self._turns.remove(client)

    def _release(self, cost: int) -> None:
        self.free += cost
        self._grant()
        m.DECODE_PIXELS.set(self.max_pixels - self.free)

    def _grant(self) -> None:
        """Grant waiters in turn, one job per client a turn; the job whose turn it is waits for its pixels
        (no one passes it, so a large image is not starved by small ones)."""
        while self._turns:
            client = self._turns[0]
            queue = self._waiters[client]
            head = queue[0]
            cancelled = head.granted.done()  # its task was cancelled and has not run its handler yet
            if not cancelled and self.free < head.cost:
                return
            queue.popleft()
            if not cancelled:  # a cancelled waiter is dropped without a turn or pixels
                self.free -= head.cost
                head.granted.set_result(None)
            if not queue:
                del self._waiters[client]
                self._turns.popleft()
            elif not cancelled:
                self._turns.rotate(-1)  # its next job waits for the other clients' turns


class _Waiter(NamedTuple):
    cost: int
    granted: asyncio.Future[None]
