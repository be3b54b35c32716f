"""One place that maps exceptions to HTTP statuses and the OpenAI error envelope.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` (vLLM's
``ErrorResponse``, the envelope the OpenAI clients parse). Validation messages are built from
``exc.errors()`` (field locations and messages only: no file paths, no echo of the request body).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Send

from server.guard.engine_client import engine_entered
from server.guard.errors import GuardError, raised_in

logger = logging.getLogger(__name__)

Handler = Callable[[Request, Exception], Awaitable[JSONResponse]]

#: Seconds a client is told to wait before retrying a 503.
RETRY_AFTER_S = 5


def error_response(
    status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An OpenAI-envelope JSON error response with the given HTTP status."""
    from server.vllm_hooks.locations import vllm_symbol

    ErrorInfo, ErrorResponse = vllm_symbol("ErrorInfo"), vllm_symbol("ErrorResponse")
    body = ErrorResponse(error=ErrorInfo(message=message, type=HTTPStatus(status).phrase, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _describe(err: Any) -> tuple[str, str | None]:
    """One validation error of any shape -> ``(text, param)``: pydantic's dict (``loc``/``msg``/``type``/
    ``ctx``), or whatever else FastAPI, Starlette or vLLM put there (vLLM raises with plain strings)."""
    if not isinstance(err, Mapping):
        return str(err), None
    raw_loc = err.get("loc", ())
    loc_parts = raw_loc if isinstance(raw_loc, list | tuple) else (raw_loc,)
    loc = [str(p) for p in loc_parts if p not in ("body", "query", "path", "header", None)]
    msg = str(err.get("msg", "invalid value"))
    ctx = err.get("ctx")
    ctx_error = ctx.get("error") if isinstance(ctx, Mapping) else None
    if err.get("type") == "json_invalid" and ctx_error:
        return f"body: {msg}: {ctx_error}", None
    where = ".".join(loc)
    return (f"{where}: {msg}" if where else msg), (loc[0] if loc else None)


#: A validation refusal names at most this many errors, each cut to this many characters: a list of bad
#: items against a union of item types gives ~60 errors an item (a 6 KB body to /v1/responses was
#: answered with a 218 MB message)
_ERRORS_SHOWN, _ERROR_CHARS = 20, 500


def validation_message(errors: Any) -> tuple[str, str | None]:
    """Turn ``RequestValidationError.errors()`` of any shape into ``(message, param)``: the first
    :data:`_ERRORS_SHOWN` errors, and how many more there are.

    Pydantic's errors keep their location without its leading ``body``/``query`` part
    (``messages: Field required``); strings and other shapes are used as they are.
    """
    items = errors if isinstance(errors, list | tuple) else [errors]
    parts: list[str] = []
    param: str | None = None
    for err in items[:_ERRORS_SHOWN]:
        text, where = _describe(err)
        parts.append(text[:_ERROR_CHARS])
        param = param or where
    more = f" (and {len(items) - _ERRORS_SHOWN} more errors)" if len(items) > _ERRORS_SHOWN else ""
    return ("; ".join(p for p in parts if p) or "invalid request") + more, param


def detail_message(detail: Any) -> str:
    """An ``HTTPException.detail`` of any shape (string, dict, list) as one message."""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, Mapping) and isinstance(detail.get("message"), str):
        return detail["message"]
    if isinstance(detail, list | tuple):
        return validation_message(detail)[0]
    return json.dumps(detail, default=str)


async def _on_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc.errors())
    return error_response(HTTPStatus.BAD_REQUEST, message, param=param)


async def _on_http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, detail_message(exc.detail), headers=exc.headers)


def unavailable_response(exc: Exception) -> JSONResponse:
    """503 + ``Retry-After`` in the OpenAI envelope: the engine is starting, restarting or gone."""
    return error_response(
        HTTPStatus.SERVICE_UNAVAILABLE, f"Engine unavailable: {exc}", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def guard_error_response(exc: GuardError) -> JSONResponse:
    """The response a guard exception states: its ``status``, ``Retry-After`` when it asks for one."""
    if exc.status == HTTPStatus.SERVICE_UNAVAILABLE:
        return unavailable_response(exc)
    wait = getattr(exc, "retry_after_s", RETRY_AFTER_S)
    headers = {"Retry-After": str(max(1, round(wait)))} if exc.retry_after else None
    return error_response(exc.status, str(exc), headers=headers)


async def _on_guard(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GuardError)
    return guard_error_response(exc)


async def _on_engine_dead(_: Request, exc: Exception) -> JSONResponse:
    return unavailable_response(exc)


#: What vLLM's serving layer raises on a request shape it reads without checking (after the body parsed).
RENDERING_ERRORS = (KeyError, AttributeError, IndexError)


def _raised_parsing_the_body(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while FastAPI turned the request body into the route's request model
    (its frames pass through FastAPI's ``request_body_to_args``): a validator of vLLM's request models
    that fails on the client's data with something other than a validation error (a ``KeyError`` on a tool
    without ``function``) is still the client's doing."""
    return raised_in(exc, frozenset({"request_body_to_args"}), "fastapi")


def _client_message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return f"missing field {exc.args[0]!r}"
    return f"{type(exc).__name__}: {exc}"


async def _on_other(request: Request, exc: Exception) -> JSONResponse:
    # vLLM's own classification: VLLMValidationError/ValueError/TypeError -> 400 (bad input that the
    # serving layer let through, e.g. max_tokens < 1), VLLMNotFoundError -> 404, others -> 500. Before it:
    # anything raised while the body was parsed into vLLM's request model is the client's (400), and so is
    # NotImplementedError (vLLM's "Unknown part type: file", 501: the request asks what this server does not do).
    from server.vllm_hooks.locations import vllm_symbol

    if _raised_parsing_the_body(exc):
        return error_response(HTTPStatus.BAD_REQUEST, f"Invalid request: {_client_message(exc)}")
    if isinstance(exc, RENDERING_ERRORS) and request.method == "POST" and not engine_entered():
        # vLLM's serving layer failed on the request's shape while rendering it (a Responses item without
        # a role: KeyError 'role'; a refusal part: AttributeError), before handing it to the engine
        logger.warning("%s rendering %s: answered 400", type(exc).__name__, request.url.path, exc_info=exc)
        return error_response(HTTPStatus.BAD_REQUEST, f"Invalid request: {_client_message(exc)}")
    if isinstance(exc, NotImplementedError):
        return error_response(HTTPStatus.BAD_REQUEST, f"Not supported by this server: {exc}")

    err = vllm_symbol("create_error_response")(exc)
    if err.error.code >= 500:
        logger.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
    return JSONResponse(err.model_dump(), status_code=err.error.code)


#: vLLM's loggers that log a client's bad request with its traceback at ERROR (``logger.exception``) on
#: routes vlguard answers 400 (:func:`anthropic_client_errors`)
CLIENT_ERROR_LOGGERS = ("vllm.entrypoints.anthropic.api_router",)


class ClientErrorWithoutStack(logging.Filter):
    """Log a client's error as one line: a record with an exception, logged before the request reached the
    engine client (the request's own bad input), loses its traceback and goes down to INFO. vLLM's Anthropic
    route logged 60 lines at ERROR for every refused image, so one client could fill the log (and push the
    lines an operator needs out of a rate-limited journal). What happens past the engine client keeps its
    stack."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and not engine_entered():
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


#: The longest log message kept (characters); a longer one is cut, its length said.
MAX_LOG_CHARS = 8192
#: The loggers whose handlers cut long messages: vLLM's, vlguard's, uvicorn's, and the root logger's.
LONG_MESSAGE_LOGGERS = ("vllm", "server", "uvicorn", "uvicorn.error", "uvicorn.access", "")


class LongMessageCut(logging.Filter):
    """Cut a record's message to :data:`MAX_LOG_CHARS`. vLLM logs strings a client chose whole: an unknown
    ``model`` of 5 MB made one 5 MB ERROR line (the event loop held 115 ms writing it), so one client could
    fill the log and push out the lines an operator needs. A handler filter: it sees every record the
    handler writes, whichever logger below it logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) <= MAX_LOG_CHARS:
            return True
        if isinstance(record.args, tuple) and record.args:
            # Formatters may read the arguments themselves (uvicorn's access formatter unpacks them: without
            # them a 9,000-character path logged a 110-line "Logging error" instead of its line): cut each.
            share = MAX_LOG_CHARS // (2 * len(record.args))
            record.args = tuple(_cut(a, share) if isinstance(a, str) else a for a in record.args)
            if len(message := record.getMessage()) <= MAX_LOG_CHARS:
                return True
        record.msg = _cut(message, MAX_LOG_CHARS)
        record.args = None
        return True


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters cut)"


def cut_long_messages() -> None:
    """Put :class:`LongMessageCut` on every handler of :data:`LONG_MESSAGE_LOGGERS` (once each)."""
    for name in LONG_MESSAGE_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, LongMessageCut) for f in handler.filters):
                handler.addFilter(LongMessageCut())


def quiet_client_errors(log_error_stack: bool = False) -> None:
    """Put :class:`ClientErrorWithoutStack` on each of :data:`CLIENT_ERROR_LOGGERS` (once); with
    ``--log-error-stack`` take it off: the operator asked for every error's stack."""
    for name in CLIENT_ERROR_LOGGERS:
        log = logging.getLogger(name)
        for found in [f for f in log.filters if isinstance(f, ClientErrorWithoutStack)]:
            log.removeFilter(found)
        if not log_error_stack:
            log.addFilter(ClientErrorWithoutStack())


def anthropic_client_errors(send: Send) -> Send:
    """``send`` for vLLM's Anthropic routes (``/v1/messages``...), which answer every exception 500
    (``internal_error``), a client's bad input included (an image the media policy refused): an error
    raised before the request reached the engine client is the client's, 400 ``invalid_request_error``
    (Anthropic's envelope kept). Anything else passes unchanged."""
    held: list[Message] = []
    body = bytearray()

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 500 and not engine_entered():
            held.append(message)
            return
        if not held or message["type"] != "http.response.body":
            await send(message)
            return
        body.extend(message.get("body", b""))
        if message.get("more_body", False):
            return
        start, data = held.pop(), bytes(body)
        try:
            answer = json.loads(data)
            if answer["error"]["type"] == "internal_error":
                answer["error"]["type"] = "invalid_request_error"
                data, start = json.dumps(answer).encode(), {**start, "status": 400}
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                start["headers"] = [*headers, (b"content-length", str(len(data)).encode())]
        except (ValueError, KeyError, TypeError):
            pass
        await send(start)
        await send({"type": "http.response.body", "body": data, "more_body": False})

    return wrapped


#: How vLLM's multimodal processor says the rendered prompt lost an item's placeholder (an assertion).
_PLACEHOLDER_LOST = "Failed to apply prompt replacement"


async def _on_assertion(request: Request, exc: Exception) -> JSONResponse:
    """vLLM's multimodal processor asserts that the rendered prompt holds every item's placeholder; a
    request that cut it away (``truncate_prompt_tokens`` below an image's tokens, vllm#57038) gets a 500
    from stock vLLM. That is the request's doing: 400. Any other assertion is a server error."""
    if str(exc).startswith(_PLACEHOLDER_LOST):
        return error_response(
            HTTPStatus.BAD_REQUEST,
            "The prompt no longer holds the placeholder of every image or video after rendering: "
            "truncate_prompt_tokens below the media's tokens, or media where the chat template renders none "
            "(an image in a tool output): keep the media inside the prompt",
            param="truncate_prompt_tokens",
        )
    return await _on_other(request, exc)


def _logging_stack(handler: Handler) -> Handler:
    """``handler`` that first logs the exception with its stack (``--log-error-stack``, as vLLM's handlers)."""

    async def logged(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s caught on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
        return await handler(request, exc)

    return logged


def _for_websockets(handler: Handler) -> Handler:
    """``handler`` for HTTP requests; a websocket whose route raised is closed instead (1011, the error
    logged): Starlette hands websocket errors to the same handlers, which answer HTTP."""

    async def either(conn: Request, exc: Exception) -> JSONResponse:
        if isinstance(conn, WebSocket):
            logger.warning("%s on websocket %s: closed", type(exc).__name__, conn.url.path, exc_info=exc)
            await conn.close(code=1011)
            return None  # type: ignore[return-value]  # Starlette sends nothing more for a websocket
        return await handler(conn, exc)

    return either


def install_error_handlers(app: FastAPI, log_error_stack: bool = False) -> None:
    """Register the exception map on ``app`` (over any handler it had for the same exception); with
    ``log_error_stack`` (``--log-error-stack``), every handled exception is logged with its stack first.

    | exception | status |
    |---|---|
    | ``RequestValidationError`` (bad JSON, missing or wrong fields) | 400 |
    | ``HTTPException`` | its own |
    | ``GuardError`` (``server.guard.errors``) | its ``status``: quarantined 400, unavailable 503 + ``Retry-After`` |
    | vLLM ``EngineDeadError`` | 503 + ``Retry-After`` |
    | ``ValueError``, ``TypeError``, vLLM's client errors (``VLLMValidationError``, ``VLLMNotFoundError``) | 400 / 404 |
    | vLLM's failed prompt replacement (``AssertionError``: the prompt lost a media placeholder) | 400 |
    | anything raised while the body is parsed into vLLM's request model (a validator's ``KeyError``) | 400 |
    | ``KeyError``, ``AttributeError``, ``IndexError`` before the request reached the engine client | 400, logged |
    | ``NotImplementedError`` (vLLM: an unknown content part type, e.g. ``file``) | 400 (vLLM: 501) |
    | anything else | vLLM's ``create_error_response`` status, 500 logged with traceback |

    Client errors get handlers of their own rather than only the catch-all: Starlette answers a
    catch-all ``Exception`` handler's response and then re-raises, so uvicorn logged a traceback for every
    such 400 and closed the client's keep-alive connection.
    """
    import vllm.exceptions as vllm_errors
    from vllm.v1.engine.exceptions import EngineDeadError

    def add(error: type[Exception], handler: Handler) -> None:
        app.add_exception_handler(error, _for_websockets(_logging_stack(handler) if log_error_stack else handler))

    add(RequestValidationError, _on_validation)
    add(StarletteHTTPException, _on_http)
    add(GuardError, _on_guard)
    add(EngineDeadError, _on_engine_dead)
    # KeyError ... NotImplementedError: a client's when raised parsing the body (above), else a 500 logged
    client_errors: list[type[Exception]] = [ValueError, TypeError, KeyError, IndexError, AttributeError]
    client_errors += [OverflowError, NotImplementedError]
    for name in ("VLLMClientError", "VLLMValidationError", "VLLMNotFoundError"):  # 0.32 has the base class
        if isinstance(found := getattr(vllm_errors, name, None), type):
            client_errors.append(found)
    for error in client_errors:
        add(error, _on_other)
    add(AssertionError, _on_assertion)
    add(Exception, _on_other)
