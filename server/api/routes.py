"""What vlguard does with each POST route of vLLM's app: one table, read by the door and the admission layer.

vlguard serves vLLM's own routes (its app's routers, adopted whole: :func:`adopt_stock_routes`). Every body
route passes the transport and the body bounds whatever it is; what else it meets depends on its kind:

* ``GENERATION``: reaches the engine: held while the engine restarts, the client's fault budget, the door's
  known-poison and media checks;
* ``INPUT``: runs the tokenizer or the multimodal processor in the API process but not the engine (tokenize,
  render): the door's media checks;
* ``NO_INPUT``: takes no prompt and no media (detokenize, cancel): the body bounds only;
* ``REFUSED``: operator or internal routes a client must not reach through the public port (404, with why).

A POST route not in the table is refused (404) until it is classified: a route a new vLLM adds stays closed,
and ``tests/api/test_routes.py`` fails for it on that vLLM's lane. Every media item any route loads meets the
media policy inside vLLM's media layer anyway (:mod:`server.vllm_hooks.media_connector`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from typing import Any


class RouteKind(enum.Enum):
    GENERATION = "generation"
    INPUT = "input"
    NO_INPUT = "no_input"
    REFUSED = "refused"


_G, _I, _N, _R = RouteKind.GENERATION, RouteKind.INPUT, RouteKind.NO_INPUT, RouteKind.REFUSED

#: POST path (a regular expression, matched whole, without ``--root-path``) -> (kind, why when refused).
POST_ROUTES: dict[str, tuple[RouteKind, str]] = {
    "/v1/chat/completions": (_G, ""),
    "/v1/completions": (_G, ""),
    "/v1/responses": (_G, ""),
    "/v1/messages": (_G, ""),  # Anthropic's Messages API (vLLM 0.32 on)
    "/invocations": (_G, ""),  # SageMaker: a chat, completion or responses body, dispatched by its shape
    "/tokenize": (_I, ""),
    "/v1/messages/count_tokens": (_I, ""),
    "/v1/chat/completions/render": (_I, ""),
    "/v1/completions/render": (_I, ""),
    "/v1/responses/render": (_I, ""),
    "/v1/messages/render": (_I, ""),
    "/v1/chat/completions/derender": (_N, ""),
    "/v1/completions/derender": (_N, ""),
    "/detokenize": (_N, ""),
    "/v1/responses/[^/]+/cancel": (_N, ""),
    "/ping": (_N, ""),
    "/v1/chat/completions/batch": (_R, "many conversations in one request, past the per-request bounds"),
    "/inference/v1/generate": (_R, "token-in generation for disaggregated serving: an internal route"),
    "/inference/v1/abort_requests": (_R, "aborts requests by id, anyone's: an internal route"),
    "/scale_elastic_ep": (_R, "rescales the engine: an operator route"),
    "/is_scaling_elastic_ep": (_R, "an operator route"),
    "/generative_scoring": (_R, "not offered by vlguard yet"),
    "/v1/systemone": (_R, "not offered by vlguard yet"),
    "/v1/decisions": (_R, "not offered by vlguard yet"),
}

_COMPILED = [(re.compile(pattern), kind, why) for pattern, (kind, why) in POST_ROUTES.items()]


def post_kind(path: str) -> tuple[RouteKind, str] | None:
    """``(kind, why refused)`` of a POST to ``path`` (without the root path); None: not classified."""
    for pattern, kind, why in _COMPILED:
        if pattern.fullmatch(path):
            return kind, why
    return None


def is_generation(path: str) -> bool:
    """Whether a POST to ``path`` reaches the engine."""
    found = post_kind(path)
    return found is not None and found[0] is RouteKind.GENERATION


def flat_routes(routes: list[Any]) -> Iterator[Any]:
    """Every route of ``routes``, routers included by FastAPI unwrapped (a route has ``path`` and ``methods``;
    mounts are left out)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from flat_routes(list(inner.routes))
        elif getattr(route, "methods", None) and getattr(route, "path", None):
            yield route


def served(routes: list[Any]) -> set[tuple[str, str]]:
    """``(method, path)`` of every route in ``routes``."""
    return {(method, route.path) for route in flat_routes(routes) for method in route.methods}
