"""The uvicorn server of every pdserve process that listens (node, router, registry).

It serves one socket bound beforehand (`pdserve.ports.bind_port`: a taken port fails the
start with one clear line; port 0 lets the OS pick a free one) and, once it accepts
connections, says where: one log line `listening on http://HOST:PORT` and, with
`--port-file PATH`, the port written to PATH. A parent (`pdserve up`, a test harness)
starts its child on port 0 and reads the file, so no two processes race for a port that
was free a moment ago (docs/architecture.md: Interfaces).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from pdserve.netaddr import http_url
from pdserve.ports import write_port_file


class ListeningServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, sock: socket.socket,
                 port_file: str | None = None, log: logging.Logger | None = None) -> None:
        super().__init__(config)
        self.sock, self.port_file = sock, port_file
        self.port_file_error: str | None = None  # set when the port file could not be written
        self.log = log or logging.getLogger("pdserve.http")

    @property
    def port(self) -> int:
        """The bound port (the OS's choice for --port 0)."""
        return int(self.sock.getsockname()[1])

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets or [self.sock])

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the lifespan's start-up ran; the socket accepts
        if self.should_exit:  # stopped during start-up: nobody should come
            return
        self.log.info("listening on %s", http_url(self.config.host, self.port))
        if self.port_file:
            try:
                write_port_file(self.port_file, self.port)
            except OSError as exc:  # checked with the flags; gone or read-only since
                self.port_file_error = f"cannot write --port-file {self.port_file}: {exc}"
                self.log.error("%s; shutting down", self.port_file_error)
                # After startup returns, so the usual shutdown (lifespan: deregister) runs;
                # uvicorn skips it when should_exit is already set here.
                asyncio.get_running_loop().call_soon(setattr, self, "should_exit", True)
