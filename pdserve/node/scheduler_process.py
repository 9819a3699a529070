"""The scheduler process: owns the engine, talks to the HTTP process over ZMQ.

Loop: receive messages (block only when the engine is idle) -> admit/abort -> one engine
step -> send the new tokens of every request as one `TokenBatch` -> periodic `Stats`.
Role-agnostic: the prefill and decode roles plug into the engine, not into this loop.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import zmq

from pdserve.engine.engine import Engine
from pdserve.node import messages as m
from pdserve.node.config import ServerConfig
from pdserve.node.roles import make_role
from pdserve.node.watchdog import Watchdog
from pdserve.pd.leg import PDLegFields
from pdserve.sampling_params import SamplingParams

log = logging.getLogger("pdserve.scheduler")
STATS_PERIOD_S = 0.25
# Only transfers pending: wait this long at most between two polls of them; the role's wake
# fd (kv_transfer/wake.py) ends the wait as soon as one changes state.
TRANSFER_POLL_MS = 2
IDLE_WAIT_MS = 100


class InputWait:
    """Waits until `recv` has a message or `fd` is readable: one poller, kept for the
    loop's life (the wait runs every few milliseconds while transfers are pending)."""

    def __init__(self, recv: zmq.Socket, fd: int) -> None:
        self.fd = fd
        self._poller = zmq.Poller()
        self._poller.register(recv, zmq.POLLIN)
        self._poller.register(fd, zmq.POLLIN)

    def __call__(self, timeout_ms: int) -> bool:
        """At most `timeout_ms`; True when either became readable."""
        return bool(self._poller.poll(timeout_ms))


class SchedulerService:
    def __init__(self, cfg: ServerConfig, recv: zmq.Socket, send: zmq.Socket) -> None:
        self.cfg = cfg
        self.recv, self.send = recv, send
        self.engine = Engine(cfg.engine, make_role(cfg))
        self.sent: dict[str, int] = {}  # rid -> output ids already sent
        self.stopping = False
        self._last_stats = 0.0
        self._stats_seq = 0
        self._wait: InputWait | None = None  # for the role's wake fd, made on first use

    def ready_message(self) -> m.Ready:
        e = self.engine
        kv_info = e.role.registry_fields()
        return m.Ready(self.cfg.model_name, e.context_length, e.loaded.hf_config.vocab_size,
                       e.max_total_tokens, self.cfg.engine.page_size, kv_info, e.describe())

    def serve_forever(self, parent_pid: int) -> None:
        self.send.send(m.encode(self.ready_message()))
        dog = Watchdog(self.cfg.watchdog_timeout_s) if self.cfg.watchdog_timeout_s else None
        try:
            self._loop(parent_pid, dog)
        finally:
            if dog is not None:
                dog.stop()

    def _loop(self, parent_pid: int, dog: Watchdog | None) -> None:
        while not self.stopping:
            if dog is not None:
                dog.beat()
            # Runnable work: do not wait. Only transfers pending: wait for a message or a
            # transfer's state change (the role's wake fd), at most TRANSFER_POLL_MS.
            if self.engine.has_runnable():
                self._receive(timeout_ms=0)
            elif self.engine.has_work():
                self._receive(timeout_ms=TRANSFER_POLL_MS, wake=True)
            else:
                self._receive(timeout_ms=IDLE_WAIT_MS)
            if self.engine.has_work():
                # First tokens that arrived with the KV (decode role) go out before the
                # next decode forward, not one step later.
                if self.engine.poll_role():
                    self._emit([])
                finished = self.engine.step(role_polled=True)
                self._emit(finished)
            elif self.sent:
                self._emit([])
            self._maybe_stats()
            if os.getppid() != parent_pid:  # the HTTP process died: do not linger
                log.warning("parent process gone; scheduler exiting")
                return

    # -- input -------------------------------------------------------------------------
    def _receive(self, timeout_ms: int, wake: bool = False) -> None:
        """Handle the messages that arrive within `timeout_ms`; with `wake`, a state change
        of a transfer (the role's wake fd) also ends the wait."""
        fd = self.engine.role.wake_fd() if wake else None
        if fd is None:
            if not self.recv.poll(timeout_ms):
                return
        else:
            if self._wait is None or self._wait.fd != fd:
                self._wait = InputWait(self.recv, fd)
            if not self._wait(timeout_ms):
                return
            self.engine.role.drain_wake()  # before the role polls its rooms
            if not self.recv.poll(0):
                return
        while True:
            try:
                frame = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(m.decode(frame))
            except ValueError as exc:
                log.warning("dropped a bad message: %s", exc)

    def _handle(self, msg) -> None:
        if isinstance(msg, m.GenerateRequest):
            self._admit(msg)
        elif isinstance(msg, m.AbortRequest):
            self.engine.abort(msg.rid)
        elif isinstance(msg, m.FlushCache):
            self.engine.flush_cache()
        elif isinstance(msg, m.Shutdown):
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            self._emit(self.engine.step() if self.engine.has_work() else [])
            self.stopping = True

    def _admit(self, msg: m.GenerateRequest) -> None:
        if self.engine.num_waiting() >= self.cfg.max_queued_requests:
            self._reply(m.Rejected(msg.rid, 429, "server is busy: the waiting queue is full"))
            return
        try:
            params = SamplingParams(**msg.sampling)
            leg = PDLegFields.from_wire(msg.leg) if msg.leg else None
            self.engine.add_request(msg.rid, msg.input_ids, params, leg, traced=msg.traced)
        except (ValueError, TypeError) as exc:
            self._reply(m.Rejected(msg.rid, 400, str(exc)))
            return
        self.sent[msg.rid] = 0
        self._reply(m.Accepted(msg.rid))

    def _reply(self, msg) -> None:
        self.send.send(m.encode(msg))

    # -- output ------------------------------------------------------------------------
    def _emit(self, finished) -> None:
        updates = []
        for rid, req in self.engine.requests.items():
            n = self.sent.get(rid, 0)
            if len(req.output_ids) > n:
                updates.append(self._update(req, n, None))
                self.sent[rid] = len(req.output_ids)
        for req in finished:
            if req.rid in self.sent:
                updates.append(self._update(req, self.sent.pop(req.rid), req.finish_reason))
        if updates:
            self.send.send(m.encode(m.TokenBatch(updates)))

    @staticmethod
    def _update(req, start: int, finish: str | None) -> dict:
        u = {"rid": req.rid, "new_ids": req.output_ids[start:], "finish_reason": finish,
             "cached_tokens": req.cached_tokens, "error": req.error,
             "error_code": req.error_code}
        if req.params.logprobs is not None:
            u["logprobs"] = req.output_logprobs[start:len(req.output_ids)]
        if req.params.prompt_logprobs is not None and start == 0:
            u["prompt_logprobs"] = req.prompt_logprobs
        if req.trace is not None and req.trace.spans:
            u["trace"] = req.trace.take()
        return u

    def _maybe_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_PERIOD_S:
            return
        self._last_stats = now
        self.send.send(m.encode(self.stats()))

    def stats(self) -> m.Stats:
        self._stats_seq += 1
        taken_at = time.time()
        e = self.engine
        s = e.memory_stats()
        cache = e.kv.cache
        hit = cache.hit_tokens / cache.query_tokens if cache and cache.query_tokens else 0.0
        used = s["total_pages"] - s["free_pages"] - s["evictable_pages"]
        return m.Stats(
            running=len(e.sched.running), waiting=len(e.sched.waiting),
            kv_usage=used / s["total_pages"], cache_hit_rate=hit,
            free_pages=s["free_pages"], total_pages=s["total_pages"],
            free_slots=s["free_slots"], total_slots=s["total_slots"],
            pools_full=e.pools_full() and not e.requests and _role_full(e.role),
            overlap_disabled=dict(e.loop.stats.overlap_disabled),
            retractions=e.sched.num_retractions, generated_tokens=e.out.generated_tokens,
            mixed_batches=e.sched.num_mixed_batches,
            role=_str_keys(e.role.stats()),
            hicache=e.hicache_stats(),
            seq=self._stats_seq, taken_at=taken_at,
        )


def _str_keys(obj):
    """msgpack maps on our wire have string keys only (histogram buckets are floats)."""
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    return obj


def _role_full(role) -> bool:
    s = role.stats()
    return s.get("free_metadata_slots") == s.get("total_metadata_slots")


def run_scheduler(cfg: ServerConfig, recv_addr: str, send_addr: str, parent_pid: int) -> None:
    """Entry point of the spawned scheduler process."""
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s scheduler: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process decides when we stop
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    send.setsockopt(zmq.LINGER, 1000)
    try:
        service = SchedulerService(cfg, recv, send)
    except Exception as exc:
        send.send(m.encode(m.Rejected("", 500, f"scheduler failed to start: {exc}")))
        raise
    signal.signal(signal.SIGTERM, lambda *_: setattr(service, "stopping", True))
    try:
        service.serve_forever(parent_pid)
    except Exception as exc:
        # An engine fault (a forward or HiCache copy thread that failed, a device error):
        # one line that says so, with the traceback; the process then exits 1, and the HTTP
        # process fails the open requests, turns /livez 503 and exits 1 itself.
        log.critical("scheduler stopped by an engine error: %s: %s", type(exc).__name__, exc,
                     exc_info=True)
        raise
    finally:
        service.engine.close()
        recv.close(0)
        send.close()
        ctx.term()
