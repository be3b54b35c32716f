"""Operational routes: liveness, readiness, version and Prometheus metrics.

``/health`` is liveness: 200 while this process can still serve or recover (including while the engine
starts or restarts), 503 only once the supervisor has given up. This differs from stock vLLM, whose
``/health`` reflects the engine; orchestrators should restart on ``/health`` and route on ``/ready``.
``/ready`` is 200 only while the engine is READY and a one-token probe (or real output) succeeded recently,
and the input guard can admit one more request.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from server import __version__
from server.api.deps import DoorSaturatedDep, SupervisorDep
from server.api.errors import RETRY_AFTER_S
from server.guard.supervisor import EngineState
from server.metrics.registry import render_latest

router = APIRouter()


@router.get("/health")
@router.api_route("/ping", methods=["GET", "POST"])
async def health(supervisor: SupervisorDep) -> JSONResponse:
    """Liveness: ``{"status": "alive"|"failed", "engine": <state>}``; 503 only when FAILED. Also SageMaker's
    ``/ping`` (stock vLLM answers it as its ``/health``)."""
    failed = supervisor.state is EngineState.FAILED
    return JSONResponse(
        {"status": "failed" if failed else "alive", "engine": supervisor.state.value},
        status_code=503 if failed else 200,
    )


@router.get("/ready")
async def ready(supervisor: SupervisorDep, saturated: DoorSaturatedDep) -> JSONResponse:
    """Readiness: 200 ``{"ready": true}`` only while the engine is READY and answered a one-token probe
    (or real traffic) recently, and the door admits work (an in-flight slot and body bytes left); 503 +
    Retry-After otherwise (starting, restarting, failed, saturated). ``rebuild``: the path a rebuild would
    take if the engine died now (``spare``, ``spare_starting``, ``cold``); ``hold_s``: how long a request
    held now would wait for the engine, seconds (:mod:`server.guard.hold`)."""
    is_ready = supervisor.is_ready() and not saturated
    body: dict[str, object] = {"ready": is_ready, "engine": supervisor.state.value, "saturated": saturated}
    gone = supervisor.state in (EngineState.FAILED, EngineState.STOPPED)  # nothing is held: refused at once
    hold_s = 0.0 if gone else round(supervisor.hold_limit(), 1)
    body |= {"rebuild": supervisor.builder.rebuild_path().value, "hold_s": hold_s}
    return JSONResponse(
        body,
        status_code=200 if is_ready else 503,
        headers=None if is_ready else {"Retry-After": str(RETRY_AFTER_S)},
    )


@router.get("/version")
async def version() -> JSONResponse:
    """``{"version": <vlguard>, "vllm_version": <vllm>, "patches": {"enabled", "active", "classes"},
    "carry_over": {"resumed", "rerun", "error_event"}}`` (``carry_over``: how a stream carried over a
    recovery continues, by what its request asks: :data:`server.guard.rerun.CARRY_OVER`)."""
    import vllm

    from server import patches
    from server.guard.rerun import CARRY_OVER

    report = {"version": __version__, "vllm_version": vllm.__version__, "patches": patches.report()}
    return JSONResponse({**report, "carry_over": CARRY_OVER})


@router.get("/metrics")
async def metrics(supervisor: SupervisorDep) -> Response:
    """Prometheus text: vLLM's ``vllm:*`` series and vlguard's ``vlguard_*`` series from every process."""
    from server.metrics import definitions as m

    m.API_TASKS.set(len(asyncio.all_tasks()))  # a leak shows as a count that only grows
    m.QUARANTINED.set(supervisor.quarantine.quarantined_count())  # also after TTL expiry or eviction
    supervisor.load.sweep()  # aborted requests' tokens, also when the abort left the engine idle
    body, content_type = render_latest()
    return Response(body, media_type=content_type)
