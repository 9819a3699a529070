"""Errors raised by `RegistryClient`; the registry's message is kept verbatim."""

from __future__ import annotations


class RegistryError(Exception):
    """Base class. `status` is the HTTP status (None when no response came back)."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


class RegistryUnavailable(RegistryError):
    """No answer, or a 5xx: worth retrying later."""


class NodeIdInUse(RegistryUnavailable):
    """409 on PUT: another instance's record of this node_id is still live (a restarted
    node's predecessor that was not deregistered): retry until it expires."""


class RegistryAuthError(RegistryError):
    """401: the token is missing or wrong; 403: the instance secret is. Retrying will not
    help until it is fixed."""


class RegistryRejected(RegistryError):
    """Another 4xx: the request itself is wrong (e.g. a record failing the schema)."""


class NodeSuperseded(RegistryError):
    """409 on PUT: a newer instance of this node_id has replaced this one."""
