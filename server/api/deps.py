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
