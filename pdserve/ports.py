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
    bind_port(host, port).close()


def tcp_socket(family: int) -> socket.socket:
    """A TCP stream socket whose accepted connections asyncio serves without Nagle."""
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def bind_port(host: str, port: int) -> socket.socket:
    """The node's HTTP socket, bound now (a taken port fails the start before anything
    loads) but not listening: connections are refused until `socket.listen()`. A PD node
    listens right before it registers, so no router learns of it before it accepts
    connections (they wait in the backlog while the server starts).

    The protocol is named (IPPROTO_TCP, not the default 0) because asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on accepted sockets whose `proto` says TCP. With
    proto 0 every small SSE write after the first waited for the client's delayed ACK:
    ~40 ms added to the first token of every request on a reused keep-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = tcp_socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        why = (f"port {port} is already in use ({exc.strerror})"
               if exc.errno == errno.EADDRINUSE else exc.strerror)
        raise PortInUse(f"cannot listen on {host}:{port}: {why}; stop what holds it or "
                        f"pass another --port") from exc
    return sock

