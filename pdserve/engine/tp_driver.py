"""Rank 0 of a TP node: starts the worker ranks, shards its own model, and stands in for the
model in `ModelRunner` (docs/architecture.md: Tensor parallelism).

`TPModel.__call__` has the model's signature. It runs on the forward thread, after the
FutureMap has resolved the input ids, so the overlap loop is unchanged: the header goes to
every worker's pipe, the batch tensors follow as one broadcast, then rank 0 runs its own
shard of the forward (the workers run theirs in lockstep, meeting at each all-reduce).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref

import torch

from pdserve.config import EngineConfig
from pdserve.engine.tp_group import TPGroup, pack_tensors, read_msg, split_meta, write_msg
from pdserve.models.parallel import TPPlan, plan_tp, shard_model

log = logging.getLogger(__name__)
WORKER_EXIT_S = 20.0  # a worker told to stop gets this long before it is killed


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r of a CUDA node runs on the r-th GPU after the configured one."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class TPModel:
    """Rank 0's stand-in for the model: hands each forward to the workers, then runs it."""

    def __init__(self, model, group: TPGroup, procs: list[subprocess.Popen]) -> None:
        self.model, self.group, self.procs = model, group, procs
        self._lock = threading.Lock()  # one forward on the wire at a time
        self._pipe = threading.Lock()  # whole messages on the pipes (forward + role threads)
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, procs)
        # What the workers report back on their stdout (PD transfers, pdserve/pd/tp_rooms).
        self.replies = WorkerReplies(len(procs))
        for rank, p in enumerate(procs, start=1):
            threading.Thread(target=self.replies.read, args=(rank, p.stdout), daemon=True,
                             name=f"pdserve-tp-reply-{rank}").start()

    def send_op(self, msg: dict) -> None:
        """An op for every worker, after everything written before it (a transfer op
        written after a forward's result was processed runs after that forward there)."""
        with self._pipe:
            for p in self.procs:
                assert p.stdin is not None  # started with stdin=PIPE
                try:
                    write_msg(p.stdin, msg)
                except (BrokenPipeError, OSError, ValueError) as exc:
                    raise RuntimeError(f"TP rank (pid {p.pid}) is gone: {exc}") from exc

    def __call__(self, input_ids, positions, meta, kv_pool, logit_rows) -> torch.Tensor:
        tensors, plain = split_meta(meta)
        tensors.update(input_ids=input_ids, positions=positions, logit_rows=logit_rows)
        specs, payload = pack_tensors(tensors)
        with self._lock:
            if self._closed:
                raise RuntimeError("the TP group is closed")
            self.send_op({"op": "forward", "specs": specs, "plain": plain,
                          "nbytes": payload.numel()})
            self.group.broadcast(payload)
            return self.model(input_ids, positions, meta, kv_pool, logit_rows)

    def paged_decode(self) -> bool:
        return self.model.paged_decode()  # every rank holds the same head shapes

    def paged_extend(self) -> bool:
        return self.model.paged_extend()

    def describe(self, plan: TPPlan, num_pages: int) -> dict:
        """The node's ranks for /server_info: every rank's pool has the same pages (one page
        table) over its own KV heads."""
        ranks = [{"rank": 0, "pid": os.getpid(), "alive": True}] + [
            {"rank": r, "pid": p.pid, "alive": p.poll() is None and r not in self.replies.dead}
            for r, p in enumerate(self.procs, start=1)]
        for r in ranks:
            r["kv_pages"] = num_pages
        return {"size": plan.size, "q_heads_per_rank": plan.local_heads,
                "kv_heads_per_rank": plan.local_kv_heads, "kv_replicated": plan.kv_replicated,
                "ranks": ranks}

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()
        self.group.close()


class WorkerReplies:
    """Messages from the workers' stdout pipes: `ready` answers (per rank) and room state
    changes (room -> per worker rank (state, reason, peer_fault)). A worker whose pipe
    closes is `dead`: every room it had counts as failed."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.cond = threading.Condition()
        self.ready: dict[int, dict] = {}
        self.rooms: dict[int, list] = {}
        self.dead: dict[int, str] = {}

    def read(self, rank: int, pipe) -> None:
        while (msg := read_msg(pipe)) is not None:
            with self.cond:
                if msg["op"] == "ready":
                    self.ready[rank] = msg
                elif msg["op"] == "room":
                    row = self.rooms.get(msg["room"])
                    if row is not None:
                        row[rank - 1] = (msg["state"], msg["reason"], msg["peer_fault"])
                self.cond.notify_all()
        with self.cond:
            self.dead[rank] = f"TP rank {rank} exited"
            self.cond.notify_all()

    def wait_ready(self, timeout: float) -> list[dict]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.ready) + len(self.dead) >= self.workers,
                                    timeout)
            if self.dead or not ok:
                raise RuntimeError(f"TP workers did not set up their KV transfer: "
                                   f"{self.dead or 'timed out'}")
            out = [self.ready[r] for r in sorted(self.ready)]
            self.ready.clear()
            return out

    def track(self, room: int) -> None:
        with self.cond:
            self.rooms[room] = [None] * self.workers

    def forget(self, room: int) -> None:
        with self.cond:
            self.rooms.pop(room, None)

    def states(self, room: int) -> list:
        """Per worker rank: (state, reason, peer_fault), or None before its first report."""
        with self.cond:
            row = list(self.rooms.get(room) or [None] * self.workers)
            for rank, why in self.dead.items():
                row[rank - 1] = (0, why, False)
            return row


def _stop_workers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.stdin is not None  # started with stdin=PIPE
        try:
            write_msg(p.stdin, {"op": "stop"})
            p.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
    deadline = time.monotonic() + WORKER_EXIT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("TP worker %d did not stop; killing it", p.pid)
            p.kill()
            p.wait()


def spawn_workers(cfg: EngineConfig, port: int) -> list[subprocess.Popen]:
    """Ranks 1..N-1, each `python -m pdserve.engine.tp_worker` with the config as JSON."""
    conf = json.dumps(dataclasses.asdict(cfg))
    return [subprocess.Popen(
        [sys.executable, "-m", "pdserve.engine.tp_worker", "--rank", str(r),
         "--port", str(port), "--config", conf], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE)
        for r in range(1, cfg.tp_size)]


def start_tp(cfg: EngineConfig, loaded) -> tuple[TPPlan, TPModel]:
    """Rank 0: check the model can be split, start the workers, join the group, shard the
    local model. Raises ValueError (before starting anything) when the TP size does not fit."""
    plan = plan_tp(loaded.hf_config, cfg.tp_size, 0)
    group = TPGroup("127.0.0.1", 0, 0, cfg.tp_size, loaded.device)
    procs = spawn_workers(cfg, group.port)
    try:
        _connect_watching(group, procs)
        shard_model(loaded.model, plan, group)
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    log.info("tensor parallel: %d ranks, %d q / %d KV heads per rank%s", cfg.tp_size,
             plan.local_heads, plan.local_kv_heads,
             " (KV heads replicated)" if plan.kv_replicated else "")
    return plan, TPModel(loaded.model, group, procs)


def _connect_watching(group: TPGroup, procs: list[subprocess.Popen]) -> None:
    """Join the group, failing fast when a worker dies while loading (bad model, OOM)."""
    err: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(group.connect, err), daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"TP worker pid {dead[0].pid} exited with "
                               f"{dead[0].returncode} before joining the group")
    if err:
        raise err[0]


def _catch(fn, err: list) -> None:
    try:
        fn()
    except BaseException as exc:  # re-raised on the caller's thread
        err.append(exc)


def send_init(model: TPModel, num_pages: int) -> None:
    """Tell the workers how many KV pages to allocate (the same on every rank)."""
    model.send_op({"op": "init", "num_pages": num_pages})
