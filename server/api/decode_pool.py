"""Image normalisation, bounded: at most so many decodes at once, within a budget of pixels in progress.

Normalising an image (:func:`server.api.media.normalized_image`) decodes all its pixels: tens of ms for
a photo, seconds and about 20 bytes a pixel at the largest size allowed. Without a bound, a few
requests of large transparent images took every CPU of the API process and a gigabyte each
(measured: ten 7000x7000 PNGs, 16.8 s and +956 MB for one request, a normal request delayed 55 s).

Normalisation runs where vLLM loads the image (:mod:`server.vllm_hooks.media_connector`), on the thread
vLLM's media connector loads it on, never on the event loop. :meth:`DecodePool.run` blocks that thread
until the job may start:

* at most ``threads`` normalisations at once (``--guard-decode-threads``);
* every job first takes its image's pixel count from a budget of pixels decoding at once
  (``--guard-decode-pixels``, at least one largest image), given back when the job ends. Waiters are
  served in arrival order, so small images cannot starve a large one.

A job that started runs to its end (a thread cannot be stopped) and only then gives its pixels back, so
the budget counts what is really in memory.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from typing import TypeVar

from server.metrics import definitions as m

T = TypeVar("T")


class DecodePool:
    """Arguments:
    threads: jobs that may run at once.
    max_pixels: pixels that may be decoding at once, over all jobs; no single job may ask for more.

    Raises:
        ValueError: ``threads`` or ``max_pixels`` below 1.
    """

    def __init__(self, threads: int, max_pixels: int) -> None:
        if threads < 1 or max_pixels < 1:
            raise ValueError(f"a decode pool needs at least one thread and one pixel, not {threads}, {max_pixels}")
        self.threads = threads
        self.max_pixels = max_pixels
        self.free = max_pixels
        self.running = 0
        self._turns = itertools.count()
        self._queue: collections.deque[int] = collections.deque()  # waiting jobs' turns, in arrival order
        self._changed = threading.Condition()

    def run(self, pixels: int, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the calling thread once a slot and ``pixels`` are free (blocks until then).

        Arguments:
            pixels: the job's cost (an image's ``width x height``); clamped to the budget, so a job the
                media policy admitted always runs, alone if need be.

        Raises:
            whatever ``fn`` raises.
        """
        cost = min(max(pixels, 0), self.max_pixels)
        with self._changed:
            turn = next(self._turns)
            self._queue.append(turn)
            m.DECODE_WAITING.set(len(self._queue))
            self._changed.wait_for(lambda: self._queue[0] == turn and self.free >= cost and self.running < self.threads)
            self._queue.popleft()
            self.free -= cost
            self.running += 1
            m.DECODE_WAITING.set(len(self._queue))
            m.DECODE_PIXELS.set(self.max_pixels - self.free)
            self._changed.notify_all()  # the next in line may fit too
        try:
            return fn(*args)
        finally:
            with self._changed:
                self.free += cost
                self.running -= 1
                m.DECODE_PIXELS.set(self.max_pixels - self.free)
                self._changed.notify_all()
