"""HTTP-process side of the ZMQ link to the scheduler process.

`submit()` sends a `GenerateRequest` and waits for the scheduler's `Accepted`/`Rejected`
(so a 429 or 400 can still become the HTTP status before any stream starts); afterwards
the request's `TokenUpdate`s arrive on its own asyncio queue. If the scheduler process
dies, every open request gets an error update and `/health` turns 503.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp

import zmq
import zmq.asyncio

from pdserve.http.errors import ApiError
from pdserve.node import messages as m

NODE_FAILED = "node_failed"  # error code of requests failed by the node's own death
log = logging.getLogger("pdserve.node")


class RequestHandle:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.updates: asyncio.Queue = asyncio.Queue()
        self.finished = False


class EngineClient:
    def __init__(self, ctx: zmq.asyncio.Context, to_sched: str, from_sched: str,
                 proc: mp.Process | None) -> None:
        self.push = ctx.socket(zmq.PUSH)
        self.push.bind(to_sched)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(from_sched)
        self.proc = proc
        self.ready: m.Ready | None = None
        self.stats: m.Stats | None = None
        self.died = asyncio.Event()  # set once the scheduler process is found dead
        self.handles: dict[str, RequestHandle] = {}
        self._tasks: list[asyncio.Task] = []

    @property
    def info(self) -> m.Ready:
        """The scheduler's Ready message (the HTTP routes serve only after `wait_ready`)."""
        assert self.ready is not None, "used before wait_ready"
        return self.ready

    @property
    def alive(self) -> bool:
        return not self.died.is_set()

    # -- lifecycle ---------------------------------------------------------------------
    async def wait_ready(self, timeout_s: float) -> m.Ready:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Ready, then the first stats (sent right after it): /server_info and the registry
        # record never show a node without its scheduler's stats.
        while self.ready is None or self.stats is None:
            if self.proc is not None and not self.proc.is_alive():
                raise RuntimeError("scheduler process exited during start-up (see its log)")
            if loop.time() > deadline:
                raise RuntimeError(f"scheduler not ready after {timeout_s:.0f}s")
            if await self.pull.poll(200):
                msg = m.decode(await self.pull.recv())
                if isinstance(msg, m.Ready):
                    self.ready = msg
                elif isinstance(msg, m.Stats):
                    self.stats = msg
                elif isinstance(msg, m.Rejected):
                    raise RuntimeError(msg.message)
        return self.ready

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._watch())]

    async def close(self, drain: bool = False) -> None:
        for t in self._tasks:
            t.cancel()
        if self.alive and (self.proc is None or self.proc.is_alive()):
            try:  # never block: with the scheduler gone a PUSH send would wait forever
                await self.push.send(m.encode(m.Shutdown(drain)), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("scheduler did not take the shutdown message")
        self.push.close(linger=500)
        self.pull.close(linger=0)

    # -- requests ----------------------------------------------------------------------------
    async def submit(self, req: m.GenerateRequest) -> RequestHandle:
        if not self.alive:
            raise ApiError(503, "the scheduler process is not running")
        handle = RequestHandle(req.rid)
        self.handles[req.rid] = handle
        try:
            await self.push.send(m.encode(req))
            await handle.accepted
        except BaseException:  # rejected, unencodable, or cancelled: never leak the handle
            self.handles.pop(req.rid, None)
            raise
        return handle

    async def abort(self, rid: str) -> None:
        handle = self.handles.pop(rid, None)
        if handle is not None and not handle.finished and self.alive:
            await self.push.send(m.encode(m.AbortRequest(rid)))

    async def flush_cache(self) -> None:
        if self.alive:
            await self.push.send(m.encode(m.FlushCache()))

    def release(self, rid: str) -> None:
        self.handles.pop(rid, None)

    # -- background tasks ----------------------------------------------------------------------
    async def _reader(self) -> None:
        while True:
            frame = await self.pull.recv()
            try:
                self._dispatch(m.decode(frame))
            except ValueError as exc:
                log.error("bad message from scheduler: %s", exc)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, m.TokenBatch):
            for u in msg.updates:
                handle = self.handles.get(u["rid"])
                if handle is not None:
                    handle.finished = u["finish_reason"] is not None
                    handle.updates.put_nowait(m.TokenUpdate(**u))
        elif isinstance(msg, m.Accepted | m.Rejected):
            handle = self.handles.get(msg.rid)
            if handle is None or handle.accepted.done():
                return
            if isinstance(msg, m.Accepted):
                handle.accepted.set_result(True)
            else:
                handle.accepted.set_exception(ApiError(msg.status, msg.message))
        elif isinstance(msg, m.Stats):
            self.stats = msg

    async def _watch(self) -> None:
        while self.proc is not None:
            await asyncio.sleep(0.2)
            if not self.proc.is_alive():
                log.error("scheduler process died (exit code %s)", self.proc.exitcode)
                self.died.set()  # alive is False from here on
                self._fail_all("the scheduler process died")
                return

    def _fail_all(self, message: str) -> None:
        for handle in list(self.handles.values()):
            if not handle.accepted.done():
                handle.accepted.set_exception(ApiError(503, message, NODE_FAILED))
            # The code tells a router the node failed, not the request: retry it elsewhere.
            handle.updates.put_nowait(m.TokenUpdate(handle.rid, [], "error", error=message,
                                                    error_code=NODE_FAILED))
