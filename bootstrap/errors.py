"""OpenAI-shaped errors for the registry: `{"error": {"message", "type", "code"}}`.

Every failure path of the app ends in `error_response`, including FastAPI's own
validation errors and Starlette's 404/405, so clients parse one shape only.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from bootstrap.store.base import StoreUnavailable

log = logging.getLogger("pdserve.registry")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None


class ErrorBody(BaseModel):
    """Documented in the OpenAPI spec for every error status."""

    error: ErrorDetail


class ApiError(Exception):
    """Raised by handlers; turned into an OpenAI-shaped response."""

    def __init__(self, status: int, message: str, code: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers


def error_response(
    status: int, message: str, code: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def describe_validation_errors(errors: list[dict[str, Any]]) -> str:
    """One readable line per problem: `body.kv_layout.num_layers: Input should be >= 1`."""
    parts = []
    for err in errors[:10]:
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", ""))
    if len(errors) > 10:
        parts.append(f"... and {len(errors) - 10} more")
    return "; ".join(parts) or "invalid request"


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette lists only the first)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, describe_validation_errors(list(exc.errors())), "invalid_input")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request)
        return error_response(exc.status_code, str(exc.detail), code, headers)

    @app.exception_handler(StoreUnavailable)
    async def _store(_: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("store unavailable: %s", exc)
        return error_response(503, "registry store unavailable", "store_unavailable")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, never client input; keep the shape and log the traceback.
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal registry error", "internal_error")
