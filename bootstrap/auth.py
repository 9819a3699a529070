"""Bearer-token check for the registry's routes.

Declared through FastAPI's `HTTPBearer` so the OpenAPI spec documents the scheme; the
compare is `hmac.compare_digest` on bytes, so its time does not reveal how many leading
characters of a guess were right.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from bootstrap.errors import ApiError

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>`")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def token_matches(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def require_token(expected: str) -> Callable[..., None]:
    """A dependency that lets a request through only with `Bearer <expected>`."""

    def check(creds: HTTPAuthorizationCredentials | None = Security(_bearer)) -> None:  # noqa: B008
        if creds is None:
            raise ApiError(401, "missing bearer token", "missing_token", _CHALLENGE)
        if not token_matches(creds.credentials, expected):
            raise ApiError(401, "invalid bearer token", "invalid_token", _CHALLENGE)

    return check
