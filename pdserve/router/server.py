"""`pdserve router`: load the tokenizer (when the model is known), read the registry once,
then serve HTTP until SIGTERM/Ctrl-C. Shutdown lets open streams finish for up to
`--drain-timeout-s`, then cancels the rest (which cancels their legs on the nodes)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket

import uvicorn

from pdserve.http.body_limit import BodyLimitMiddleware
from pdserve.http.guard import guarded_protocol
from pdserve.http.listening import ListeningServer
from pdserve.ports import bind_port, listen_port
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.gateway import Gateway
from pdserve.router.tokenizer import RouterTokenizer

log = logging.getLogger("pdserve.router")


def _exit_cleanly(_signum, _frame) -> None:
    raise SystemExit(0)


def serve(cfg: RouterConfig) -> int:
    # SIGTERM before uvicorn runs (tokenizer loading) ends the process at once; during the
    # run uvicorn handles it (graceful shutdown) and then re-raises it, which lands here
    # again: exit status 0 for a stop that was asked for, not death by signal.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.log_level != "debug":  # one line per registry poll and per leg otherwise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    # Bound and listening now (a taken port fails before the tokenizer loads; 0 picks a
    # free one); uvicorn serves it later, then logs the port and writes --port-file.
    with bind_port(cfg.host, cfg.port) as sock:
        listen_port(sock, cfg.host, cfg.port)  # connections wait in the backlog until served
        cfg = dataclasses.replace(cfg, port=sock.getsockname()[1])
        # With --model the tokenizer loads now: a wrong model fails at start, not per request.
        tokenizer = RouterTokenizer(cfg.model, cfg.model_cache_dir, cfg.chat_template,
                                    cfg.revision) \
            if cfg.model else None
        return asyncio.run(_serve_async(cfg, tokenizer, sock))


async def _serve_async(cfg: RouterConfig, tokenizer: RouterTokenizer | None,
                       sock: socket.socket) -> int:
    gw = Gateway(cfg, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await gw.start()
        log.info("router on port %d, registry %s: %s", cfg.port, cfg.registry,
                 gw.table.counts())
        yield
        await gw.close()

    app = build_app(gw, lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.http.max_body_bytes)
    server = ListeningServer(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
        # uvicorn's type hint says int; it takes seconds as a float
        timeout_graceful_shutdown=cfg.drain_timeout_s,  # type: ignore[arg-type]
        access_log=cfg.log_level == "debug",
        http=guarded_protocol(cfg.http)), sock, cfg.port_file, log)
    await server.serve()
    return 1 if server.port_file_error else 0
