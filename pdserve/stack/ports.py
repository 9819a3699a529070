"""Loopback ports for the stack's children."""

from __future__ import annotations

import socket


class PortInUse(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now. Another process may take it before the child binds it;
    the stack then restarts that child on a new port (see Stack)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUse(f"port {port} on {host} is already in use ({exc.strerror}); "
                               f"stop what holds it or pass another --port") from exc
