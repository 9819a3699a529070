"""Loopback port helpers shared by every process kind that listens (node, router, stack)."""

from __future__ import annotations

import errno
import socket


class PortInUse(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Fail before loading anything when another process holds the port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            why = (f"port {port} is already in use ({exc.strerror})"
                   if exc.errno == errno.EADDRINUSE else exc.strerror)
            raise PortInUse(f"cannot listen on {host}:{port}: {why}; stop what holds it or "
                            f"pass another --port") from exc
