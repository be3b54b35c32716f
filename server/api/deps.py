"""Typed FastAPI dependencies for app state (no module-level globals)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.guard.supervisor import Supervisor


def get_supervisor(request: Request) -> Supervisor:
    """The supervisor the app was created with."""
    supervisor: Supervisor = request.app.state.supervisor
    return supervisor


SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]


def get_door_saturated(request: Request) -> bool:
    """Whether the input guard would refuse one more request whose body arrived (every in-flight slot or
    the body budget taken; False before its first request built it)."""
    guard = getattr(request.app.state, "input_guard", None)
    return bool(guard is not None and guard.saturated())


DoorSaturatedDep = Annotated[bool, Depends(get_door_saturated)]
