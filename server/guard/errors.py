"""The guard's exceptions. Each carries the HTTP status it means (the KServe way); ``server.api.errors``
is the one place that turns them into responses, so nothing in ``server.guard`` imports ``server.api``."""

from __future__ import annotations

from http import HTTPStatus


class GuardError(Exception):
    """Base of the guard's exceptions: ``status`` is the HTTP status, ``retry_after`` whether the client
    should be told to come back (``Retry-After``)."""

    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    retry_after: bool = False


class EngineUnavailableError(GuardError, RuntimeError):
    """The request cannot be served by an engine now. HTTP 503 + ``Retry-After``.

    ``reason`` (``vlguard_requests_failed_total{reason}``): ``hold_timeout`` (not READY in time, or the
    probation slot), ``too_many_held``, ``engine_failed``, ``not_ready``, ``stopped``, ``replay_limit``,
    ``not_resumable``.

    Arguments:
        message: for the client.
        reason: label of ``vlguard_requests_failed_total{reason}``.
    """

    status = HTTPStatus.SERVICE_UNAVAILABLE
    retry_after = True

    def __init__(self, message: str, reason: str = "hold_timeout") -> None:
        super().__init__(message)
        self.reason = reason


class NotResumableError(EngineUnavailableError):
    """The engine died after tokens were streamed and this request cannot be resumed. HTTP 503."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="not_resumable")


class QuarantinedRequestError(GuardError, ValueError):
    """The request was in the failing step of too many engine faults and is refused. HTTP 400."""

    status = HTTPStatus.BAD_REQUEST
