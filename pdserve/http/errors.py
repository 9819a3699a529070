"""The one exception every HTTP-facing check raises (docs/architecture.md: Interfaces), and
how it reaches the client: an OpenAI-shaped body `{"error": {"message", "type", "code"}}`
with `status` as the HTTP status. Node, router and the SGLang bootstrap endpoint install
the same handlers, so every error any pdserve server writes has this shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pdserve.http")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
               499: "client_closed_request", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(ApiError(status, message, code)), status_code=status)


def error_body(exc: ApiError) -> dict:
    kind = ERROR_TYPES.get(exc.status, "server_error")
    return {"error": {"message": exc.message, "type": kind, "code": exc.code or exc.status}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            parts.append(f"{loc}: {e.get('msg', 'invalid')}")
        return error_response(400, "invalid request: " + "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        # A bug, never client input: keep the error shape (not Starlette's plain text).
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
