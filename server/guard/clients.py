"""Per-client fault budget: a client whose requests keep faulting the engine is refused for a cool-down.

Quarantine is by fingerprint, so a client that varies its poison (a new seed, another word, another image)
gets a new fingerprint each time and two more faults. This module counts, per client, the faults charged
to that client's requests with certainty (the fault named one request: the failing code was handling it,
or it ran alone on probation); past ``max_faults`` within ``window_s`` the client is refused with 429 +
``Retry-After`` for ``cooldown_s``. Faults charged to a whole step of many requests give strikes to each
(the quarantine) but charge no client: an innocent client that shared a poison's first step is not
punished for it.

Who a client is (:func:`client_key`): the API key it presented when the server has several, else its
remote address as uvicorn reports it, an IPv6 address by its /64 (one subscriber's prefix: a client that
rotates addresses inside it stays one client); a loopback address, IPv4-mapped ones included (a proxy or
sidecar on the host: every client looks the same), is no identity, and its faults charge no client budget
(docs/guard.md). A request may present one ``Authorization`` header only
(:mod:`server.api.transport`), the one vLLM authenticated.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import hashlib
import ipaddress
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus

from starlette.types import Scope

from server.guard.errors import GuardError
from server.guard.peers import Change, Peers, Received

#: The client of the request being served (set at the door, read by the engine client).
current_client: contextvars.ContextVar[str] = contextvars.ContextVar("vlguard_client", default="")


class ClientRefusedError(GuardError):
    """The client's requests were charged with too many engine faults; refused for a cool-down. HTTP 429
    + ``Retry-After``."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    retry_after = True

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def client_key(scope: Scope, keys: int) -> str:
    """The identity of the client behind an HTTP ``scope``, or "" when it cannot be told apart from others
    (its faults then charge no client budget: the quarantine alone bounds them).

    Arguments:
        scope: the ASGI scope.
        keys: how many API keys the server has. With two or more, the presented key identifies the
            client; with one, every client presents the same key, so the address is used.

    Returns:
        ``"key:<12 hex>"`` (a hash of the bearer token, never the key itself), ``"addr:<host>"``, or "" for
        a loopback or unknown address: behind a proxy or sidecar on the same host every client is
        loopback, and one client's faults must not refuse them all.
    """
    if keys > 1:
        auth = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), b"")  # vLLM's: the first
        scheme, _, token = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and token:
            return "key:" + hashlib.sha256(token.encode()).hexdigest()[:12]
    client = scope.get("client")
    return address_key(client[0] if client else "")


@functools.lru_cache(maxsize=4096)  # a pure function of the host, asked on every request
def address_key(host: str) -> str:
    """``"addr:<IPv4>"``, ``"addr:<IPv6 /64>"``, or "" for a loopback (IPv4-mapped too) or unparsable host."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return ""
    if isinstance(address, ipaddress.IPv6Address):
        return f"addr:{ipaddress.IPv6Network((address, 64), strict=False)}"
    return f"addr:{address}"


class ClientBudget:
    """Faults charged to each client within a window, and who is refused.

    Arguments:
        max_faults: faults within ``window_s`` that refuse a client (0: never).
        window_s: seconds over which faults are counted.
        cooldown_s: seconds a refused client stays refused.
        max_clients: clients remembered at most (least recently charged forgotten first).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        max_faults: int,
        window_s: float,
        cooldown_s: float,
        max_clients: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_faults = max_faults
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self.max_clients = max_clients
        self._clock = clock
        self._faults: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self._refused_until: dict[str, float] = {}
        #: the other API processes of this server, told of each fault (:mod:`server.guard.peers`); None: alone
        self.peers: Peers | None = None
        self.received = Received()  # their faults, taken in at the next read

    def charge(self, clients: Iterable[str]) -> list[str]:
        """Count one fault for each client (peers too). Returns the clients this made refused."""
        clients = sorted({c for c in clients if c})
        if self.peers is not None and clients:
            self.peers.publish(Change("client_faults", tuple(clients), self._clock()))
        if self.received:
            self._take_received()
        return self._charge(clients)

    def _take_received(self) -> None:
        for change in self.received.take():
            if change.kind == "client_faults":
                self._charge((c for c in change.values if c), change.at)

    def _charge(self, clients: Iterable[str], at: float | None = None) -> list[str]:
        """One fault for each client, made ``at`` (a peer's, taken in late; None: now)."""
        current = self._clock()
        when, newly = current if at is None else at, []
        for client in set(clients):
            if not client:
                continue
            times = self._faults.pop(client, None) or collections.deque()
            times.append(when)
            if len(times) > 1 and times[-2] > when:  # a peer's, older than one counted here
                times = collections.deque(sorted(times))
            while times and current - times[0] > self.window_s:
                times.popleft()
            self._faults[client] = times
            if self.max_faults and len(times) >= self.max_faults and self._left(client) == 0:
                self._refused_until[client] = when + self.cooldown_s
                newly.append(client)
        while len(self._faults) > self.max_clients:
            self._faults.popitem(last=False)
        return sorted(newly)

    def refused_for(self, client: str) -> float:
        """Seconds ``client`` stays refused (0: it is served)."""
        if self.received:
            self._take_received()
        return self._left(client)

    def _left(self, client: str) -> float:
        until = self._refused_until.get(client)
        if until is None:
            return 0.0
        left = until - self._clock()
        if left <= 0:  # its faults stay counted: one more within the window refuses it again
            del self._refused_until[client]
            return 0.0
        return left

    def refused_count(self) -> int:
        """Clients refused now."""
        if self.received:
            self._take_received()
        return sum(1 for client in list(self._refused_until) if self._left(client) > 0)

    def check(self, client: str) -> None:
        """Raises:
        ClientRefusedError: ``client`` is in its cool-down."""
        if (left := self.refused_for(client)) > 0:
            raise ClientRefusedError(
                f"Too many engine faults were caused by this client's requests ({self.max_faults} within "
                f"{self.window_s:g} s); retry in {left:.0f} s",
                retry_after_s=left,
            )
