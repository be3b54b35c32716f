"""Operator routes: list and clear the quarantine without a restart.

``GET /admin/quarantine`` lists every fingerprint the quarantine remembers (strikes, seconds since the
last, whether it is refused now); ``DELETE /admin/quarantine`` forgets them all and
``DELETE /admin/quarantine/{fingerprint}`` one (it is served again). With ``--api-key`` (or
``VLLM_API_KEY``) the routes need the key as ``Authorization: Bearer``, like ``/v1``; without one they
answer only clients on the loopback interface, so an unprotected server does not let the network lift a
quarantine.
"""

from __future__ import annotations

import hmac
import ipaddress
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request

from server.api.deps import SupervisorDep
from server.metrics import definitions as m

router = APIRouter(prefix="/admin")


def _api_keys(request: Request) -> list[str]:
    import vllm.envs as envs

    args = request.app.state.args
    return [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]


def require_operator(request: Request) -> None:
    """Raises:
    HTTPException: 401 without the API key (when one is set); 403 from a non-loopback client (when none is)."""
    keys = _api_keys(request)
    if keys:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not any(hmac.compare_digest(given.encode(), key.encode()) for key in keys):
            raise HTTPException(HTTPStatus.UNAUTHORIZED, "admin routes need the API key")
        return
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise HTTPException(HTTPStatus.FORBIDDEN, "admin routes answer loopback clients only when no API key is set")


Operator = Annotated[None, Depends(require_operator)]


@router.get("/quarantine")
async def list_quarantine(supervisor: SupervisorDep, _: Operator) -> dict[str, Any]:
    """``{"quarantine_deaths": K, "entries": [{"fingerprint", "strikes", "last_strike_s_ago", "refused"}]}``."""
    q = supervisor.quarantine
    return {
        "quarantine_deaths": q.deaths,
        "entries": [
            {"fingerprint": fp, "strikes": n, "last_strike_s_ago": round(age, 1), "refused": n >= q.deaths}
            for fp, n, age in q.entries()
        ],
    }


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
