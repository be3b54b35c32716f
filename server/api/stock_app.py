"""vLLM's own app, made by vLLM's own builder once the engine is up, served behind vlguard's shell.

vlguard's app (:func:`server.app.create_app`) is a shell around this one: the transport, CORS, the door,
admission, and vlguard's own routes (liveness, readiness, metrics, version, operator routes). Every other
request goes on to the app ``build_app`` makes for the server's arguments, tasks and model, its state set up
by vLLM's ``init_app_state`` over the guarded engine client. So its routes, its middleware (``--api-key`` on
``/v1``, ``--enable-request-id-headers``, ``--middleware``, SageMaker's, a later vLLM's), its docs
(``--enable-offline-docs``) and whatever a later vLLM adds to them behave as stock by construction.

Where vlguard differs from that app, it is here, each for a reason:

* vlguard's exception map (:func:`server.api.errors.install_error_handlers`) replaces vLLM's: vLLM's engine
  error handler shuts the server down on an engine death, which the guard recovers from, and vLLM answers
  some client errors 500;
* vLLM's CORS middleware is left out: vlguard's shell applies the same one, from the same flags, in front of
  the door, so that the door's own refusals carry the CORS headers too;
* a client's error that vLLM's Anthropic route logs with its traceback is logged in one line, unless
  ``--log-error-stack`` (:func:`server.api.errors.quiet_client_errors`).
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.admission import route_path
from server.api.errors import cut_long_messages, install_error_handlers, quiet_client_errors, unavailable_response
from server.api.request_fixes import install_completion_fixes
from server.api.routes import flat_routes


class StockApp:
    """ASGI app: vLLM's app once :func:`build_stock_app` made it (``app``); until then 503 + ``Retry-After``
    (``Engine unavailable``), a websocket closed with 1013 (try again later)."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await unavailable_response(RuntimeError("the engine is starting"))(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013})


class ToStockApp:
    """The innermost layer of vlguard's shell (after the door and admission): a request for none of the
    shell's own routes goes straight to vLLM's app, past the shell's exception layer, exit stack and
    router, which it would only fall through to the same app (~0.1 ms a request here). A path that may be
    the shell's still takes the shell's router (which falls back to vLLM's app).

    Arguments:
        app: the rest of the shell (its exception layer, router and routes); lifespan events go there.
        stock: vLLM's app (:class:`StockApp`).
        paths: the shell's route paths (``/health``, ``/admin/quarantine/{fingerprint}``); a path with
            parameters stands for every path that starts with its part before the first ``{``.
    """

    def __init__(self, app: ASGIApp, stock: ASGIApp, paths: list[str]) -> None:
        self.app, self.stock = app, stock
        self.exact = frozenset(p for p in paths if "{" not in p)
        self.prefixes = tuple(p[: p.index("{")] for p in paths if "{" in p)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self._shells(route_path(scope)):
            await self.stock(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _shells(self, path: str) -> bool:
        return path in self.exact or path.startswith(self.prefixes) or path.rstrip("/") in self.exact


async def build_stock_app(args: argparse.Namespace, client: Any, tasks: tuple[str, ...]) -> FastAPI:
    """vLLM's app for ``args``, ``tasks`` and ``client``'s model (``build_app``), its state set up over
    ``client`` (``init_app_state``), with the differences the module states.

    Raises:
        whatever vLLM's builder raises: a ``--middleware`` that does not import, a bad flag combination.
    """
    from server.vllm_hooks.locations import vllm_symbol

    app: FastAPI = vllm_symbol("build_app")(args, tasks, client.model_config)
    await vllm_symbol("init_app_state")(client, app.state, args, tasks)
    log_error_stack = bool(getattr(args, "log_error_stack", False))
    install_error_handlers(app, log_error_stack=log_error_stack)
    quiet_client_errors(log_error_stack)
    cut_long_messages()  # vLLM's, vlguard's and uvicorn's handlers are all set up by now
    # vLLM's handlers for what vlguard's map leaves to its catch-all (engine errors, vLLM's error base class)
    app.exception_handlers = {
        error: handler for error, handler in app.exception_handlers.items() if not _is_vllms(handler)
    }
    app.user_middleware = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
    app.middleware_stack = None  # built again with the above at the first request (a builder may have built it)
    if (completion := getattr(app.state, "openai_serving_completion", None)) is not None:
        install_completion_fixes(completion)
    return app


def _is_vllms(handler: Any) -> bool:
    return str(getattr(handler, "__module__", "")).startswith("vllm.")


def route_lines(app: FastAPI) -> list[str]:
    """``METHOD path`` of every route of ``app`` (for the start-up log)."""
    return sorted(f"{method} {route.path}" for route in flat_routes(app.routes) for method in route.methods)
