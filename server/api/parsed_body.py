"""The door's parse of a request body, handed to vLLM's route so the body is parsed once.

The door (:mod:`server.api.input_guard`) parses every POST body with pydantic's JSON parser before it checks
it. vLLM's routes then parse the same bytes again: FastAPI's request handler (and a route that reads its body
itself) calls Starlette's ``Request.json()``, which is ``json.loads`` on the event loop: 0.1 ms for the front
workload's median body, 0.27 ms for 418 KB, 85 ms for 50 MB, against 0.013 / 0.03 ms for the door's parser
(``docs/benchmarks.md``).

:func:`hand_over` puts the door's parse beside the bytes it hands on, in the ASGI scope; :func:`install`
makes ``Request.json()`` take it when the body it read is those bytes (compared: ~6 ms for 50 MB; a
middleware that rewrote the body hands the route other bytes, and ``json.loads`` runs as stock). The door's
parse equals ``json.loads`` of the bytes wherever the door lets a body through: pydantic's parser takes no
body ``json.loads`` refuses and gives the same values (duplicate keys, big integers, float rounding,
surrogate pairs), and what it refuses the door parses with ``json.loads`` itself
(``tests/unit/test_parsed_body.py``).

As with stock, every reader gets a parse of its own: the first ``Request.json()`` of the request takes the
door's (a ``--middleware`` that reads the body, else the route), later ones parse the bytes again, so what
one reader changes in its parse no other sees. A request that waits for the engine drops the parse first
(:func:`drop`): the body budget counts bytes, and a parse can be 8-32 times its body's bytes.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.types import Scope

#: The scope key: a :class:`_Handed`.
PARSED_BODY = "vlguard.parsed_body"


class _Handed:
    """The door's parse of ``raw``, for one taker."""

    __slots__ = ("parsed", "raw")

    def __init__(self, raw: bytes, parsed: Any) -> None:
        self.raw: bytes | None = raw
        self.parsed = parsed

    def take(self, body: bytes) -> tuple[bool, Any]:
        """``(True, parse)`` once, for the same bytes; then ``(False, None)``."""
        if self.raw is None or body != self.raw:
            return False, None
        parsed = self.parsed
        self.drop()
        return True, parsed

    def drop(self) -> None:
        self.raw = self.parsed = None


def hand_over(scope: Scope, raw: bytes, parsed: Any) -> Scope:
    """``scope`` with ``parsed`` (``json.loads(raw)``, the same values) handed over for ``raw``."""
    return {**scope, PARSED_BODY: _Handed(raw, parsed)}


def drop(scope: Scope) -> None:
    """Let go of the parse handed over in ``scope``, if any (the route then parses the bytes as stock)."""
    if (handed := scope.get(PARSED_BODY)) is not None:
        handed.drop()


def install() -> None:
    """Make Starlette's ``Request.json()`` take a handed-over parse for the same body bytes (idempotent).
    Without one in the scope, for other bytes, or once taken, it is Starlette's own."""
    stock = Request.json
    if getattr(stock, "takes_handed_over", False):
        return

    async def json(self: Request) -> Any:
        handed = self.scope.get(PARSED_BODY)
        if handed is not None and not hasattr(self, "_json"):
            taken, parsed = handed.take(await self.body())
            if taken:
                self._json = parsed
        return await stock(self)

    json.takes_handed_over = True  # type: ignore[attr-defined]
    Request.json = json  # type: ignore[method-assign,assignment]
