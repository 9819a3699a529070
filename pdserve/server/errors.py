"""The one exception every HTTP-facing check raises (docs/architecture.md: Interfaces):
it becomes an OpenAI-shaped error `{"error": {"message", "type", "code"}}` with `status`."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
