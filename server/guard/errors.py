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


def raised_in(exc: BaseException, functions: frozenset[str], path_part: str = "") -> bool:
    """Whether ``exc``'s traceback passes through a function named in ``functions`` (whose file's path holds
    ``path_part``)."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in functions and path_part in code.co_filename:
            return True
        tb = tb.tb_next
    return False


class UnsendableRequestError(GuardError, ValueError):
    """The engine refused the request before accepting it, for something in the request itself (vLLM's
    ``AsyncLLM.add_request`` raised ``EngineGenerateError`` from an ``OverflowError``, ``TypeError``...: an
    integer beyond 64 bits in ``vllm_xargs`` cannot be serialised to the engine core). HTTP 400; nothing
    reached the engine core, nothing is charged."""

    status = HTTPStatus.BAD_REQUEST

    #: The causes that are the request's: serialising or converting what the client sent.
    CAUSES: tuple[type[BaseException], ...] = (OverflowError, TypeError, KeyError, IndexError, UnicodeError)

    #: Where vLLM adds a request (``AsyncLLM.add_request``, the engine-core client's ``add_request_async``).
    ADDING = frozenset({"add_request", "add_request_async", "_add_request"})

    @classmethod
    def of(cls, cause: BaseException | None) -> UnsendableRequestError | None:
        """The client's error for ``cause`` if it is one of :data:`CAUSES` raised while vLLM added the request
        (a frame of :data:`ADDING` in its traceback); None otherwise: the same types raised by vLLM's output
        handler reach every waiting request and are the server's."""
        if not isinstance(cause, cls.CAUSES) or not raised_in(cause, cls.ADDING):
            return None
        return cls(f"The request cannot be sent to the engine: {type(cause).__name__}: {cause}")
