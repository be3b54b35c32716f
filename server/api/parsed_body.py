"""The door's parse of a request body, handed to vLLM's route so the body is parsed once.

The door (:mod:`server.api.input_guard`) parses every POST body with pydantic's JSON parser before it checks
it. vLLM's routes then parse the same bytes again: FastAPI's request handler (and a route that reads its body
itself) calls Starlette's ``Request.json()``, which is ``json.loads`` on the event loop, ~1.4 ms for a body
with a 300 KB image against the door's ~0.07 ms (``docs/benchmarks.md``), ~4 ms a megabyte.

:func:`hand_over` puts the door's parse beside the bytes it hands on, in the ASGI scope; :func:`install`
makes ``Request.json()`` take it when the body it read is those bytes (compared: ~10 us for 400 KB; a
middleware that rewrote the body hands the route other bytes, and ``json.loads`` runs as stock). The door's parse
equals ``json.loads`` of the bytes wherever the door lets a body through: pydantic's parser takes no body
``json.loads`` refuses and gives the same values (duplicate keys, big integers, float rounding, surrogate
pairs), and what it refuses the door parses with ``json.loads`` itself (``tests/unit/test_parsed_body.py``).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.types import Scope

#: The scope key: ``(body bytes, their parse)``.
PARSED_BODY = "vlguard.parsed_body"


def hand_over(scope: Scope, raw: bytes, parsed: Any) -> Scope:
    """``scope`` with ``parsed`` (``json.loads(raw)``, the same values) handed over for ``raw``."""
    return {**scope, PARSED_BODY: (raw, parsed)}


def install() -> None:
    """Make Starlette's ``Request.json()`` take a handed-over parse for the same body bytes (idempotent).
    Without one in the scope, or for other bytes, it is Starlette's own."""
    stock = Request.json
    if getattr(stock, "takes_handed_over", False):
        return

    async def json(self: Request) -> Any:
        handed = self.scope.get(PARSED_BODY)
        if handed is not None and not hasattr(self, "_json") and await self.body() == handed[0]:
            self._json = handed[1]
        return await stock(self)

    json.takes_handed_over = True  # type: ignore[attr-defined]
    Request.json = json  # type: ignore[method-assign,assignment]
