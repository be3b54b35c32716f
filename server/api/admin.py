"""Operator routes: list and clear the quarantine without a restart.

``GET /admin/quarantine`` lists every fingerprint the quarantine remembers (strikes, seconds since the
last, whether it is refused now); ``DELETE /admin/quarantine`` forgets them all and
``DELETE /admin/quarantine/{fingerprint}`` one (it is served again).

Who may call them is decided by credentials, never by the address alone (behind a proxy or sidecar on
the same host every client is loopback):

- a request that carries an ``Origin`` header is refused (403): a web page in a browser on the host, or a
  DNS-rebinding page, cannot reach them whatever CORS allows;
- with ``--guard-operator-key`` set, only that key (``Authorization: Bearer <key>``) opens them;
- else with ``--api-key`` (or ``VLLM_API_KEY``) set, an API key does, read exactly as vLLM reads it on
  ``/v1`` (scheme ``Bearer`` in any case, the token after one space);
- with no key at all they are closed (403), unless ``--guard-admin-loopback on`` opts in to trusting
  loopback clients (a single-host setup with no proxy in front).
"""

from __future__ import annotations

import ipaddress
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request

from server.api.deps import SupervisorDep
from server.api.transport import bearer_matches
from server.metrics import definitions as m

router = APIRouter(prefix="/admin")


def _api_keys(request: Request) -> list[str]:
    import vllm.envs as envs

    args = request.app.state.args
    return [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]


def require_operator(request: Request) -> None:
    """Raises:
    HTTPException: 403 for a request with an ``Origin`` header, or with no key configured (unless loopback
        clients are trusted and this is one); 401 without a configured key."""
    if "origin" in request.headers:
        raise HTTPException(HTTPStatus.FORBIDDEN, "admin routes refuse requests from web pages (Origin header)")
    settings = request.app.state.settings
    operator_key = settings.operator_key.get_secret_value() if settings.operator_key else ""
    keys = [operator_key] if operator_key else _api_keys(request)
    if keys:
        if not bearer_matches(request.headers.get("authorization", ""), keys):
            which = "operator key" if operator_key else "API key"
            raise HTTPException(HTTPStatus.UNAUTHORIZED, f"admin routes need the {which}")
        return
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not (settings.admin_loopback and loopback):
        raise HTTPException(
            HTTPStatus.FORBIDDEN,
            "admin routes need --guard-operator-key or --api-key (or --guard-admin-loopback on for loopback clients)",
        )
    if not _own_host(request):
        raise HTTPException(
            HTTPStatus.FORBIDDEN, "admin routes trust loopback clients only under the server's own Host"
        )


def _own_host(request: Request) -> bool:
    """Whether the request's ``Host`` names this server: ``localhost``, a loopback address, or the address it
    listens on. A page whose name was rebound to the loopback (DNS rebinding) sends its own name: with the
    loopback trusted and no key, its script would otherwise read the operator routes."""
    host = request.headers.get("host", "")
    name = (
        host[1:].partition("]")[0]
        if host.startswith("[")
        else host.rpartition(":")[0]
        if host.count(":") == 1
        else host
    )
    server = request.scope.get("server") or ("",)
    if name.lower() == "localhost" or name == server[0]:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


Operator = Annotated[None, Depends(require_operator)]


@router.get("/quarantine")
async def list_quarantine(supervisor: SupervisorDep, _: Operator) -> dict[str, Any]:
    """``{"quarantine_deaths": K, "entries": [{"fingerprint", "strikes", "last_strike_s_ago", "refused",
    "record"}]}``; ``record`` is the fingerprint's forensic record (a path on the server, ``--guard-forensics-dir``),
    or null."""
    q, forensics = supervisor.quarantine, supervisor.forensics
    entries = []
    for fp, n, age in q.entries():
        path = forensics.path(fp) if forensics is not None else None
        entry = {"fingerprint": fp, "strikes": n, "last_strike_s_ago": round(age, 1), "refused": n >= q.deaths}
        entries.append({**entry, "record": str(path) if path is not None else None})
    return {"quarantine_deaths": q.deaths, "entries": entries}


@router.delete("/quarantine")
async def clear_quarantine(supervisor: SupervisorDep, _: Operator) -> dict[str, int]:
    """Forget every fingerprint: ``{"cleared": N}``."""
    cleared = supervisor.quarantine.clear()
    m.QUARANTINED.set(supervisor.quarantine.quarantined_count())
    return {"cleared": cleared}


@router.delete("/quarantine/{fingerprint}")
async def clear_fingerprint(fingerprint: str, supervisor: SupervisorDep, _: Operator) -> dict[str, int]:
    """Forget one fingerprint: ``{"cleared": 0|1}``."""
    cleared = supervisor.quarantine.clear(fingerprint)
    m.QUARANTINED.set(supervisor.quarantine.quarantined_count())
    return {"cleared": cleared}
