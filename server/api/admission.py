"""Hold generation requests at the door while the engine starts or restarts (pure ASGI middleware).

A request that arrives while the engine is not READY waits (bounded by ``hold_timeout`` and
``max_held``) before vLLM's route handler runs, so that a stream can still be refused with a proper
503 + ``Retry-After`` instead of a 200 followed by an error event. Requests already inside an engine are
carried over deaths by the engine client.

The door also names the request's client (:func:`server.guard.clients.client_key`, kept in
:data:`server.guard.clients.current_client` for the engine client) and refuses a client whose requests
spent its fault budget with 429 + ``Retry-After``. A held request whose caller leaves (or whose
``X-Request-Timeout`` passes: :mod:`server.api.caller`) stops waiting at once.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from server.api import parsed_body
from server.api.caller import Caller
from server.api.errors import guard_error_response
from server.api.routes import is_generation
from server.guard.clients import ClientRefusedError, client_key, current_client
from server.guard.errors import EngineUnavailableError
from server.guard.supervisor import EngineState, Supervisor
from server.metrics import definitions as m


def route_path(scope: Scope) -> str:
    """The path the app routes on: ``scope["path"]`` without ``--root-path`` (Starlette routes the same way;
    comparing the raw path let every request under a root path past the door)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] or "/" if root and path.startswith(root) else path


class AdmissionMiddleware:
    """Arguments:
    app: the ASGI app to guard.
    supervisor: whose readiness gates generation requests.
    keys: how many API keys the server has (two or more identify clients)."""

    def __init__(self, app: ASGIApp, supervisor: Supervisor, keys: int = 0) -> None:
        self.app = app
        self.supervisor = supervisor
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST" and is_generation(route_path(scope))):
            await self.app(scope, receive, send)
            return
        client = client_key(scope, self.keys)
        current_client.set(client)
        try:
            self.supervisor.clients.check(client)
        except ClientRefusedError as exc:
            m.REQUESTS_REJECTED.labels(reason="client_faults").inc()
            await guard_error_response(exc)(scope, receive, send)
            return
        if self.supervisor.state is not EngineState.READY:
            parsed_body.drop(scope)  # a held request keeps its bytes (the body budget's count), not their parse
            try:
                if not await self._hold(scope.get(Caller.SCOPE_KEY)):
                    return  # its caller went, or its deadline passed (the door answers that)
            except EngineUnavailableError as exc:
                m.REQUESTS_FAILED.labels(reason=exc.reason).inc()
                response = guard_error_response(exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _hold(self, caller: Caller | None) -> bool:
        """Wait for the READY engine while the caller is there: False when it left first.

        Raises:
            EngineUnavailableError: the hold's own refusals (:meth:`Supervisor.acquire`).
        """
        if caller is None:
            await self.supervisor.acquire()
            return True
        acquire = asyncio.ensure_future(self.supervisor.acquire())
        gone = asyncio.ensure_future(caller.gone.wait())
        try:
            await asyncio.wait((acquire, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not acquire.done():
                acquire.cancel()
        if not acquire.done() or acquire.cancelled():
            await asyncio.wait((acquire,))  # out of the hold before the door answers
            return False
        acquire.result()
        return True
