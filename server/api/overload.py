"""Admission under load: a generation request is let in only when the engine can expect to serve it in time.

Checked by the door (:mod:`server.api.input_guard`) before the request's body is read, so a refusal costs
no parse and no decode (under ``--scheduling-policy priority`` after the parse, whose ``priority`` it
reads). In order:

1. ``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` as vLLM 0.32 means them (PR #49445, its
   ``AsyncLLM.check_admission``: unfinished requests plus this one's sequences above the cap, or prompt
   tokens in the prefill phase at or above it: 503); on the lanes whose vLLM lacks them this is their
   backport. With N API processes each holds ``1/N`` of the caps (vLLM 0.32 shares a counter instead);
2. the expected wait (:meth:`server.guard.load.EngineLoad.expected_wait`) above ``--guard-max-queue-wait``:
   503 + ``Retry-After`` (reason ``saturated``); readiness reports it so balancers route elsewhere;
3. with ``X-Request-Timeout: S``: the expected wait plus the recent service time above S (reason
   ``deadline``: it would be answered after its caller gave up);
4. while requests wait, a client (:func:`server.guard.clients.client_key`) already holding its share of
   what is admitted (the larger of ``--guard-inflight-share`` of it and an equal split between the
   clients holding any): 429 for that client alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from server.api.poison import sequences
from server.guard.load import EngineLoad, Queue
from server.metrics import definitions as m


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted now: its status, message, metric reason and ``Retry-After`` seconds."""

    status: HTTPStatus
    message: str
    reason: str
    retry_after_s: int

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None


@dataclass(frozen=True)
class QueueCaps:
    """vLLM 0.32's ``--max-num-queued-reqs`` and ``--max-num-queued-tokens`` (None: no cap), this API
    process's share of them."""

    requests: int | None = None
    tokens: int | None = None

    @classmethod
    def of(cls, requests: int | None, tokens: int | None, processes: int) -> QueueCaps:
        def share(cap: int | None) -> int | None:
            return None if cap is None else math.ceil(cap / max(1, processes))

        return cls(share(requests), share(tokens))


def _retry_after(wait_s: float, bound_s: float) -> int:
    """Seconds until the queue may have drained below the bound (1 to 60)."""
    return max(1, min(60, math.ceil(wait_s - bound_s) if math.isfinite(wait_s) else 60))


class AdmissionGate:
    """Arguments:
    load: the engine's measured queue and rates.
    max_queue_wait_s: ``--guard-max-queue-wait`` (0: no estimate).
    client_share: ``--guard-inflight-share``.
    caps: the queue caps (:class:`QueueCaps`).
    after_parse: admit after the body's parse (``--scheduling-policy priority``: the request's ``priority``
        decides whether it waits behind the queue)."""

    def __init__(
        self,
        load: EngineLoad,
        max_queue_wait_s: float,
        client_share: float,
        caps: QueueCaps = QueueCaps(),
        after_parse: bool = False,
    ) -> None:
        self.load = load
        self.inside = 0  # generation requests admitted here and not yet ended (the door counts them)
        self.max_queue_wait_s = max_queue_wait_s
        self.client_share = client_share
        self.caps = caps
        self.after_parse = after_parse

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """A generation request admitted here, from its arrival until it ends: ahead of the next arrivals
        until it reaches the engine (:attr:`inside`)."""
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def saturated(self) -> bool:
        """Whether a request arriving now would be refused for the expected wait (readiness)."""
        return bool(self.max_queue_wait_s) and self.load.expected_wait() > self.max_queue_wait_s

    def before_body(self, who: str, held: Mapping[str, int], timeout_s: float | None) -> Refusal | None:
        """The refusal of a generation request of client ``who`` before its body is read (``held``: each
        client's requests inside the server now); None: admit it, or decide after the parse."""
        if self.after_parse:
            return None
        return self.refusal(who, held.get(who, 0) if who else 0, len(held), timeout_s)

    def after_body(self, who: str, held: Mapping[str, int], timeout_s: float | None, body: Any) -> Refusal | None:
        """The refusal once the body is parsed (the request holds its own slot in ``held`` now): its
        sequences against ``--max-num-queued-reqs``; under ``--scheduling-policy priority`` the whole gate,
        with its ``priority``."""
        if not isinstance(body, dict):
            return None
        asked = sequences(body)
        mine = held.get(who, 0) - 1 if who else 0
        if self.after_parse:
            priority = body.get("priority", 0)
            urgent = isinstance(priority, int) and priority < 0
            return self.refusal(who, mine, len(held), timeout_s, asked, urgent, counted=True)
        if asked > 1 and self.caps.requests is not None:  # the caps alone: the rest was checked before
            return self.refusal(who, mine, len(held), timeout_s, asked, urgent=True)
        return None

    def refusal(
        self,
        who: str = "",
        held: int = 0,
        clients: int = 0,
        timeout_s: float | None = None,
        sequences: int = 1,
        urgent: bool = False,
        counted: bool = False,
    ) -> Refusal | None:
        """The refusal of a generation request arriving now, or None to admit it.

        Arguments:
            who: its client ("" when it has no identity).
            held: requests its client holds inside the server now.
            clients: clients holding requests now.
            timeout_s: its ``X-Request-Timeout``, if it sent one.
            sequences: the sequences it asks for (``n``; 1 before the body is read).
            urgent: it ranks before the default priority under ``--scheduling-policy priority``: the queue
                ahead of it is not the whole queue, so only the caps apply.
            counted: it is among :attr:`inside` already (decided after its body).

        The wait is estimated over the engine's queue and the requests admitted here that have not reached
        the engine yet (their bodies read, parsed, images decoded): under a burst, a queue read from the
        engine alone admitted a whole burst before any of it arrived there.
        """
        if not self.max_queue_wait_s and self.caps == QueueCaps():
            return None  # nothing to check: the queue is not read (O(requests in the engine))
        queue = self.load.queue()
        if (found := self._over_caps(queue, sequences)) is not None:
            return found
        if not self.max_queue_wait_s or urgent:
            return None
        if pending := max(0, self.inside - counted - queue.unfinished):
            queue = Queue(queue.waiting + pending, queue.queued_tokens, queue.unfinished + pending)
        wait = self.load.expected_wait(queue)
        m.QUEUE_EXPECTED_WAIT.set(wait if math.isfinite(wait) else 1e9)
        bound = self.max_queue_wait_s
        if wait > bound:
            return Refusal(HTTPStatus.SERVICE_UNAVAILABLE,
                           f"Server saturated: a request arriving now would wait about {wait:.1f} s for the "
                           f"engine (limit {bound:g} s); retry later or on another replica",
                           "saturated", _retry_after(wait, bound))  # fmt: skip
        if timeout_s is not None and (answer := wait + self.load.service_s()) > timeout_s:
            return Refusal(HTTPStatus.SERVICE_UNAVAILABLE,
                           f"Server busy: a request arriving now would be answered in about {answer:.1f} s, "
                           f"after its X-Request-Timeout of {timeout_s:g} s; retry later or on another replica",
                           "deadline", _retry_after(answer, timeout_s))  # fmt: skip
        if who and queue.waiting and clients > 1:
            admitted = queue.unfinished + 1
            limit = max(1, math.ceil(self.client_share * admitted), math.ceil(admitted / clients))
            if held >= limit:
                return Refusal(HTTPStatus.TOO_MANY_REQUESTS,
                               f"Too many requests from this client while others wait: {held} in progress "
                               f"(its share now {limit}); retry later",
                               "client_share", _retry_after(wait, 0))  # fmt: skip
        return None

    def _over_caps(self, queue: Queue, sequences: int) -> Refusal | None:
        caps = self.caps
        if caps.requests is not None and queue.unfinished + sequences > caps.requests:
            return Refusal(HTTPStatus.SERVICE_UNAVAILABLE,
                           "The engine is currently busy and cannot accept new requests. Please try again "
                           f"later or on a different instance (--max-num-queued-reqs {caps.requests}).",
                           "queued_reqs", 1)  # fmt: skip
        if caps.tokens is not None and queue.queued_tokens >= caps.tokens:
            return Refusal(HTTPStatus.SERVICE_UNAVAILABLE,
                           "The engine has reached its prefill token backlog limit. Please try again later "
                           f"or on a different instance (--max-num-queued-tokens {caps.tokens}).",
                           "queued_tokens", 1)  # fmt: skip
        return None
