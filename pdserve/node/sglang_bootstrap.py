"""Prefill node: the bootstrap endpoint of SGLang's PD wire protocol (docs/architecture.md:
Interfaces, "Behind SGLang's router").

SGLang's router names a request's prefill to the decode worker only by address: it adds
`bootstrap_host` (the prefill URL's host) and `bootstrap_port` (given per prefill on the
router's command line) to the body. With `--disaggregation-bootstrap-port`, a prefill node
serves on that port what a decode node needs to reach it, the same fields its registry
record has: `GET /bootstrap` answers `{"node": {node_id, instance_id, role, kv_endpoint,
transfer_session, transfer_backend, model, page_size, kv_layout, http_url}}` (a TP node
also `tp_size`, `kv_endpoints`, `kv_heads_total`). The decode side is
`pdserve/node/sglang_bootstrap_peer.py`. SGLang's router does not tell the prefill the decode's
TP size, so through it prefill and decode must run the same TP size (a mismatch fails at
the transfer handshake naming the TP ranks).

The server runs in the node's HTTP process beside the main uvicorn server, on a socket
bound before the node registers (so a taken port fails the start with one line, and port
0 picks a free port that is then known: /server_info shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from fastapi import FastAPI

from pdserve.http.errors import error_response, install_error_handlers
from pdserve.http.guard import HttpLimits, guarded_protocol
from pdserve.ports import check_port_free, tcp_socket

PUBLIC_FIELDS = ("node_id", "instance_id", "role", "http_url", "kv_endpoint",
                 "transfer_session", "transfer_backend", "model", "page_size", "kv_layout",
                 "tp_size", "kv_endpoints", "kv_heads_total")


def bind_bootstrap_socket(host: str, port: int) -> socket.socket:
    """Listening socket for the endpoint; raises ports.PortInUse with a clear message."""
    check_port_free(host, port)  # a taken port (or bad host) as one clear PortInUse line
    sock = tcp_socket(socket.AF_INET6 if ":" in host else socket.AF_INET)  # no Nagle
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bootstrap_app(record: dict) -> FastAPI:
    node = {k: record[k] for k in PUBLIC_FIELDS if k in record}
    app = FastAPI(title="pdserve prefill bootstrap", openapi_url=None, docs_url=None,
                  redoc_url=None)
    install_error_handlers(app)

    @app.get("/bootstrap")
    async def bootstrap():
        return {"node": node}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/route")
    async def route():  # SGLang's own decode asks here for its rank table: not ours
        return error_response(400, "this is a pdserve prefill node: SGLang decode workers "
                                   "cannot pair with it; use pdserve decode nodes")

    return app


class _QuietServer(uvicorn.Server):
    """The node's main server owns the signal handlers; this one is stopped by it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class BootstrapServer:
    def __init__(self, sock: socket.socket, record: dict, limits: HttpLimits) -> None:
        """`limits`: the node's header/body timeouts and connection cap, which this port
        needs as much as the main one (it faces the same clients)."""
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self.server = _QuietServer(uvicorn.Config(
            bootstrap_app(record), lifespan="off", log_level="warning", access_log=False,
            http=guarded_protocol(limits)))
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 5)
        self.sock.close()
