"""Transfer backends: `mooncake` (default) and `tcp` (bytes over ZMQ)."""

from __future__ import annotations

from collections.abc import Callable

from kv_transfer.backends.base import BackendUnavailable, TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.memory import HostMemory


def create_backend(config: KVTransferConfig, memory: HostMemory | None = None,
                   on_stranger: Callable[[], None] = lambda: None) -> TransferBackend:
    """Create the configured backend inside the calling process (never before a fork).
    `on_stranger`: called for each incoming write refused for its KV token (tcp)."""
    if config.backend == "mooncake":
        from kv_transfer.backends.mooncake import MooncakeBackend

        return MooncakeBackend(config)  # registers device pointers as they are
    from kv_transfer.backends.tcp import TcpBackend

    return TcpBackend(config, memory, on_stranger)


def mooncake_import_error() -> str | None:
    """None when Mooncake's engine imports here, else why not (for a clear node message)."""
    from kv_transfer.backends.mooncake import set_mooncake_env

    set_mooncake_env()
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for a missing libibverbs.so.1
        return f"{type(exc).__name__}: {exc}"
    return None


def available_backends() -> list[str]:
    return ["mooncake", "tcp"] if mooncake_import_error() is None else ["tcp"]


__all__ = ["BackendUnavailable", "TransferBackend", "available_backends", "create_backend",
           "mooncake_import_error"]
