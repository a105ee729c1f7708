"""Errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``, whatever failed.

Handlers are registered for our own ``APIError``, FastAPI/pydantic validation errors (400, not
FastAPI's 422), Starlette's HTTP errors (unknown route, wrong method) and engine failures, so a
client never sees a bare ``{"detail": ...}`` or a plain-text 500.

An unexpected failure is logged with its traceback and the request id; the client gets only a
generic message naming that request id (no exception text, traceback or server path).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_client import EngineDeadError, QueueFullError

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


RETRY_AFTER_S = 1  # a full server frees sequences quickly
DRAIN_RETRY_AFTER_S = 5  # a draining one is going away: try another replica, or later


def overloaded(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "server_overloaded", {"Retry-After": str(RETRY_AFTER_S)})


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and takes no new requests", "server_error", None,
                    "server_shutting_down", {"Retry-After": str(DRAIN_RETRY_AFTER_S)})


def stopped_by_shutdown() -> APIError:
    return APIError(503, "the server shut down before this request finished", "server_error", None,
                    "server_shutdown")


def internal_error(request_id: str | None) -> APIError:
    return APIError(500, f"internal server error (request id {request_id or 'unknown'})", "server_error")


def engine_dead(reason: str) -> APIError:
    return APIError(500, f"the inference engine is not running: {reason}", "server_error", None, "engine_dead")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> Response:
    body = msgspec.json.encode(error_body(error.message, error.type, error.param, error.code))
    return Response(body, status_code=error.status, media_type="application/json", headers=error.headers or None)


def _request_id(request: Request) -> str | None:
    return (request.scope.get("state") or {}).get("request_id")


def validation_error(errors: list[dict]) -> APIError:
    """A readable 400 from pydantic's error list: ``field.path: what is wrong`` (first few)."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    if len(errors) > 3:
        parts.append(f"({len(errors) - 3} more errors)")
    return bad_request("; ".join(parts) or "invalid request", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_: Request, exc: ValidationError) -> Response:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = error_response(APIError(exc.status_code, message, kind))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(engine_dead(str(exc)))

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> Response:
        return error_response(overloaded(f"the server is overloaded, retry later ({exc})"))

    @app.exception_handler(Exception)  # anything else: log it, tell the client only the request id
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return error_response(error_for(exc, _request_id(request)))


def error_for(exc: BaseException, request_id: str | None = None) -> APIError:
    """The API error a failure during generation maps to (also used inside SSE streams)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(str(exc))
    if isinstance(exc, QueueFullError):
        return overloaded(f"the server is overloaded, retry later ({exc})")
    if isinstance(exc, ValueError):  # the engine rejected the request
        return bad_request(str(exc))
    log.error("unexpected error while serving request %s", request_id, exc_info=exc)
    return internal_error(request_id)
