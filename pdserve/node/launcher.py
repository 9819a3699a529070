"""`pdserve serve`: start the scheduler process, then serve HTTP until SIGTERM/Ctrl-C.

Shutdown order: a PD node first drains (drain.py: deregister, 503 "draining" for new
requests, open requests finish for up to --drain-timeout-s); then uvicorn stops accepting
and lets open requests finish (bounded by `GRACEFUL_S`), the lifespan exit tells the
scheduler to abort what is left and stop, and the scheduler process is joined
(terminated, then killed, if it does not exit in time).
A scheduler that dies fails every open request; the node answers 503 for `DEATH_GRACE_S`,
then shuts down the same way and exits 1. No process outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess

import uvicorn
import zmq.asyncio

from pdserve.http.body_limit import BodyLimitMiddleware
from pdserve.http.guard import guarded_protocol
from pdserve.node.api import build_app
from pdserve.node.config import ServerConfig
from pdserve.node.drain import NodeServer, wait_drained
from pdserve.node.engine_client import EngineClient
from pdserve.node.frontend import Frontend
from pdserve.node.metrics import Metrics
from pdserve.ports import PortInUse, bind_port, check_port_free, listen_port

log = logging.getLogger("pdserve.node")
GRACEFUL_S = 10
# A dead scheduler: /livez answers 503 this long (the failed requests' errors reach their
# clients, a probe sees why), then the node exits 1 for its supervisor to restart it.
DEATH_GRACE_S = 2.0
STARTUP_TIMEOUT_S = 900  # first start may convert SmolLM2 from GGUF


def _run_scheduler(*args) -> None:
    """The scheduler process's entry, imported only there: this (HTTP) process never
    loads torch, the model code or the engine (seconds of CPU at every start)."""
    from pdserve.node.scheduler_process import run_scheduler

    run_scheduler(*args)


def start_scheduler(cfg: ServerConfig, ipc_dir: str) -> tuple[BaseProcess, str, str]:
    to_sched = f"ipc://{ipc_dir}/to_sched"
    from_sched = f"ipc://{ipc_dir}/from_sched"
    proc = mp.get_context("spawn").Process(
        target=_run_scheduler, args=(cfg, to_sched, from_sched, os.getpid()),
        name="pdserve-scheduler", daemon=True)
    return proc, to_sched, from_sched


def stop_process(proc: BaseProcess, timeout: float = 10) -> None:
    if proc.pid is None:  # start-up failed before the process was started
        return
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


# A unix socket's path must fit sockaddr_un.sun_path: 108 bytes with the NUL on Linux.
SUN_PATH_MAX = 107


def ipc_tempdir(base: str | None = None) -> tempfile.TemporaryDirectory[str]:
    """The folder of the node's two IPC sockets (removed at exit): under TMPDIR, or under
    /tmp when a socket path there would be too long for a unix socket (a deep TMPDIR, as
    a job scheduler's or a test's, would otherwise fail the start in zmq)."""
    base = base or tempfile.gettempdir()
    longest = os.path.join(base, "pdserve-" + "x" * 8, "from_sched")
    if len(os.fsencode(longest)) > SUN_PATH_MAX:
        base = "/tmp"
    return tempfile.TemporaryDirectory(prefix="pdserve-", dir=base)


def serve(cfg: ServerConfig) -> int:
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    http_sock = bind_port(cfg.host, cfg.port)  # listens only once the node is ready
    # --port 0: the OS picked the port; the record, /server_info and the logs say which.
    cfg = dataclasses.replace(cfg, port=http_sock.getsockname()[1])
    if cfg.role == "prefill" and cfg.pd and cfg.pd.bootstrap_port:  # before loading any
        check_port_free(cfg.host, cfg.pd.bootstrap_port)
    from pdserve.models.builtin import resolve_model

    eng = cfg.engine  # clear error early; a Hub model is downloaded here, once
    path = resolve_model(eng.model, eng.model_cache_dir, revision=eng.revision,
                         weights=eng.load_format == "auto")
    with http_sock, ipc_tempdir() as ipc_dir:
        proc, to_sched, from_sched = start_scheduler(cfg, ipc_dir)
        try:
            return asyncio.run(_serve_async(cfg, proc, to_sched, from_sched, path,
                                            http_sock))
        finally:
            stop_process(proc)


def _register(cfg, client, front, extra: dict):
    from pdserve.node.registration import PrefillPeerResolver, register_node

    registry, record = register_node(cfg, client.ready, lambda: client.stats, extra)
    front.metrics.watch_registry(registry)
    if cfg.role == "decode":
        front.leg_resolver = PrefillPeerResolver(registry, record)
    log.info("registered as %s (%s) at %s", record["node_id"], cfg.role, cfg.pd.registry_url)
    return registry, record


def _bootstrap_socket(cfg):
    """Prefill with --disaggregation-bootstrap-port: the bound socket of SGLang's bootstrap
    endpoint (docs/architecture.md: Interfaces), before registering, so a taken port fails
    the start and port 0 is resolved for the record."""
    if cfg.role != "prefill" or cfg.pd.bootstrap_port is None:
        return None
    from pdserve.node.sglang_bootstrap import bind_bootstrap_socket

    return bind_bootstrap_socket(cfg.host, cfg.pd.bootstrap_port)


async def _serve_async(cfg, proc, to_sched, from_sched, model_path, http_sock) -> int:
    from pdserve.models.tokenizer import load_tokenizer, read_chat_template

    ctx = zmq.asyncio.Context()
    client = EngineClient(ctx, to_sched, from_sched, proc)
    proc.start()
    # The tokenizer loads while the scheduler process loads the model.
    tok = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, model_path))
    try:
        await client.wait_ready(STARTUP_TIMEOUT_S)
        tokenizer = await tok
    except Exception as exc:  # the scheduler failed or the tokenizer would not load
        log.error("%s", exc)
        await asyncio.gather(tok, return_exceptions=True)
        await client.close()
        ctx.term()
        return 1
    if cfg.chat_template:  # --chat-template replaces the model's (read at start-up)
        tokenizer.chat_template = read_chat_template(cfg.chat_template)
    client.start()
    front = Frontend(cfg, client, tokenizer, Metrics(lambda: client.stats))
    # Accept connections from here on (they wait in the backlog until uvicorn runs): a
    # router that learns of us from the registry must never find the port closed.
    registry = bootstrap = None
    try:
        listen_port(http_sock, cfg.host, cfg.port)
    except PortInUse as exc:  # another server bound the port first and now listens
        print(f"pdserve {cfg.role}: error: {exc}", file=sys.stderr, flush=True)
        await client.close()
        ctx.term()
        return 1
    if cfg.pd is not None:
        from pdserve.node.registration import RegistrationFailed

        try:
            sock = _bootstrap_socket(cfg)
            extra = {} if sock is None else {"bootstrap_port": sock.getsockname()[1]}
            registry, record = await asyncio.to_thread(_register, cfg, client, front, extra)
        except (RegistrationFailed, PortInUse) as exc:  # one clear line, no traceback
            print(f"pdserve {cfg.role}: error: {exc}", file=sys.stderr, flush=True)
            await client.close()
            ctx.term()
            return 1
        if sock is not None:
            from pdserve.node.sglang_bootstrap import BootstrapServer

            bootstrap = BootstrapServer(sock, record, cfg.http)
            bootstrap.start()
            front.bootstrap_port = bootstrap.port
            log.info("SGLang bootstrap endpoint on %s:%d", cfg.host, bootstrap.port)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if bootstrap is not None:
            await bootstrap.stop()
        if registry is not None:  # leave the registry first: no new legs come our way
            await asyncio.to_thread(registry.close)
        await client.close()  # tells the scheduler to abort what is left and exit
        if front.tracer is not None:  # the spans still queued go out now
            await asyncio.to_thread(front.tracer.shutdown)

    async def drain():
        """SIGTERM on a PD node: leave the registry first, then let open requests finish."""
        t0 = time.monotonic()
        front.draining = True
        log.info("SIGTERM: draining; %d open requests", len(client.handles))
        if registry is not None:
            await asyncio.to_thread(registry.deregister)
        left = await wait_drained(lambda: len(client.handles), cfg.pd.drain_grace_s,
                                  cfg.pd.drain_timeout_s)
        log.info("drained in %.1fs%s", time.monotonic() - t0,
                 f"; {left} requests still open are aborted" if left else "")

    app = build_app(front, lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.http.max_body_bytes)
    # After a drain the open requests are done (or given up): uvicorn need not wait long.
    # It logs `listening on URL` and writes --port-file once it serves: after the node
    # listens and registers (docs/architecture.md: Interfaces).
    server = NodeServer(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
        timeout_graceful_shutdown=2 if cfg.pd is not None else GRACEFUL_S,
        access_log=cfg.log_level == "debug", http=guarded_protocol(cfg.http)),
        http_sock, cfg.port_file, drain if cfg.pd is not None else None)
    async def exit_when_the_scheduler_dies():
        await client.died.wait()
        log.critical("the scheduler process died (exit code %s): this node exits 1 in %gs",
                     proc.exitcode, DEATH_GRACE_S)
        await asyncio.sleep(DEATH_GRACE_S)
        server.should_exit = True

    watcher = asyncio.ensure_future(exit_when_the_scheduler_dies())
    log.info("serving %s (%s)", cfg.model_name, cfg.role)
    try:
        await server.serve()
    finally:
        watcher.cancel()
    ctx.term()
    return 1 if client.died.is_set() or server.port_file_error else 0
