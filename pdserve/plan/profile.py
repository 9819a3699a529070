"""`pdserve profile`: measure one node with the real engine in this process.

- extend (prefill) steps: single prompts of several lengths (chunked by the node's
  `--chunked-prefill-size`) and a batch of several prompts; every step's new tokens,
  attention pairs and wall time;
- decode steps: batches of several sizes at two or three context lengths, every shape
  in two passes (`measure_decode`);
- KV transfer between two real processes (`profile_transfer.py`);
- the KV pool's capacity at `--kv-cache-mb`;
- the step's slowdown with other runnable threads beside it (`profile_contention.py`).
Steps are timed around `Engine.step()` on the normal loop, so scheduling and result
processing count, as they do on a CPU node (docs/architecture.md: Automatic loop choice).
The cost models are fitted in `profile_model.py`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from kv_transfer.config import Backend
from pdserve.config import EngineConfig
from pdserve.plan.profile_model import Profile, fit_nonneg
from pdserve.sampling_params import SamplingParams

QUICK: dict[str, Any] = {"prompts": [32, 128, 384, 768, 1536], "batch_prompts": (4, 512),
         "decode_batches": [1, 4, 16, 32], "contexts": [64, 768], "decode_tokens": 12,
         "decode_passes": 2, "reps": 3, "transfer_sizes": [64, 512, 2048], "transfer_reps": 3,
         "contention_levels": 2, "contention_s": 1.5}
FULL: dict[str, Any] = {"prompts": [32, 128, 256, 512, 1024, 1536, 2047], "batch_prompts": (8, 256),
        "decode_batches": [1, 2, 4, 8, 16, 32, 64], "contexts": [64, 512, 1536],
        "decode_tokens": 16, "decode_passes": 2, "reps": 3,
        "transfer_sizes": [64, 256, 1024, 4096], "transfer_reps": 5, "contention_levels": 3,
        "contention_s": 3.0}


class StepRecorder:
    """Wraps the executor's `launch` to learn the shape of each step's batch."""

    def __init__(self, engine) -> None:
        self.engine, self.shape = engine, None
        launch = engine.executor.launch

        def recording(batch):
            rows = batch.rows
            if batch.kind == "extend":
                attn = sum(r.q_len * (r.start + r.q_len) for r in rows)
                self.shape = ("extend", sum(r.q_len for r in rows), attn, len(rows))
            else:
                self.shape = ("decode", len(rows), sum(r.start + 1 for r in rows), len(rows))
            return launch(batch)

        engine.executor.launch = recording

    def run(self, prompts: list[list[int]], max_new: int, rng: random.Random) -> list[tuple]:
        eng = self.engine
        for ids in prompts:
            eng.add_request(f"p{rng.getrandbits(48)}", ids, SamplingParams(
                max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
        points: list[tuple] = []
        while eng.has_work():
            self.shape = None
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            if self.shape is not None:
                points.append((*self.shape, dt))
        eng.loop.drain()
        return points


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 1000) for _ in range(n)]


def measure_decode(rec, rng: random.Random, plan: dict, max_running: int,
                   limit: int, row_limit: Callable[[int], int] | None = None) -> list[tuple]:
    """Decode steps of every (context, batch) shape of `plan`, all shapes once per pass,
    `decode_passes` passes. The fit keeps each shape's fastest step (`best_of`), but one
    shape's steps all run within a second or two: a burst of other work then slows every
    one of them (seen: a 4 x 770-token batch profiled at 63-80 ms, 33 ms when measured
    again), and the fitted context cost doubled. A later pass measures that shape again.
    `row_limit(ctx)`: the most rows of that context the KV pool holds at once. A batch
    above it never steps whole (the engine queues the rest), so it is measured at that
    many rows instead: without it the long contexts kept only their smallest batches, and
    the context cost, fitted from them, came out at a third of a 10 x 1100-token step's."""
    decode: list[tuple] = []
    for _ in range(plan.get("decode_passes", 1)):
        for ctx in plan["contexts"]:
            fits = row_limit(min(ctx, limit)) if row_limit is not None else max_running
            for b in sorted({min(b, max_running, max(1, fits))
                             for b in plan["decode_batches"]}):
                pts = rec.run([_ids(rng, min(ctx, limit)) for _ in range(b)],
                              plan["decode_tokens"], rng)
                decode += [p for p in pts if p[0] == "decode" and p[3] == b][1:]
    return decode


def measure_engine(cfg: EngineConfig, plan: dict, log=print) -> tuple[dict, object]:
    from pdserve.engine.engine import Engine

    # The normal loop, whatever the node's --loop: an overlapped step() returns once the
    # next forward is launched, so around it the forward itself would not be timed (with
    # one thread on two cores, `auto` overlaps: extend steps of 1536 tokens "took" 1.5 ms).
    eng = Engine(replace(cfg, loop="normal"))
    rec, rng = StepRecorder(eng), random.Random(0)
    limit = eng.context_length - plan["decode_tokens"] - 2
    rec.run([_ids(rng, 16)], 2, rng)  # warm-up
    extend = []
    for _ in range(plan["reps"]):
        for n in plan["prompts"]:
            extend += [p for p in rec.run([_ids(rng, min(n, limit))], 1, rng) if p[0] == "extend"]
        k, n = plan["batch_prompts"]
        extend += [p for p in rec.run([_ids(rng, n) for _ in range(k)], 1, rng)
                   if p[0] == "extend"]
    log(f"  prefill: {len(extend)} extend steps measured")
    page = eng.cfg.page_size

    def row_limit(ctx: int) -> int:
        # A row's pages counted above what the scheduler's admission rule asks (context
        # plus a decode reservation of at most decode_reserve_tokens): the context, every
        # token it decodes and a full reservation besides, and one page more. A batch one
        # row over the pool's edge never steps whole and its shape is lost; one row under
        # costs nothing.
        tokens = ctx + plan["decode_tokens"] + eng.cfg.decode_reserve_tokens
        return eng.max_total_tokens // (-(-tokens // page) * page + page)

    decode = measure_decode(rec, rng, plan, cfg.max_running_requests, limit, row_limit)
    log(f"  decode: {len(decode)} decode steps measured")
    slowdown = [1.0]
    if plan.get("contention_levels", 0):
        from pdserve.plan.profile_contention import measure_contention

        slowdown = measure_contention(rec, rng, _ids, plan["contention_levels"],
                                      seconds=plan.get("contention_s", 1.5))
        log(f"  contention: step slowdown {[round(x, 2) for x in slowdown]} with 0.. "
            "spinning processes beside it")
    info = {"extend": [list(p) for p in extend], "decode": [list(p) for p in decode],
            "pool_tokens": eng.max_total_tokens, "bytes_per_token": eng.layout.bytes_per_token,
            "layout": (eng.layout.num_layers, eng.layout.num_kv_heads, eng.layout.head_dim,
                       str(eng.layout.dtype).removeprefix("torch.")),
            "describe": eng.describe(), "contention": slowdown}
    assert eng.pools_full(), "profiling leaked KV pages"
    eng.close()
    return info, eng


def best_of(points: list[list], ctx_bucket: int) -> list[list]:
    """Lowest time per batch shape (noise from other processes only adds time, as in
    bench/forward.py); decode contexts grouped in buckets of `ctx_bucket` tokens per row."""
    best: dict[tuple, list] = {}
    for p in points:
        key = (p[0], p[1], p[3], p[2] // max(1, ctx_bucket * p[3]))
        if key not in best or p[4] < best[key][4]:
            best[key] = p
    return list(best.values())


def fit_steps(info: dict) -> tuple[list[float], list[float]]:
    ext = np.array([[1.0, p[1], p[2] / 1e6, p[4]] for p in best_of(info["extend"], 1 << 30)])
    dec = np.array([[1.0, p[1], p[2] / 1e3, p[4]] for p in best_of(info["decode"], 256)])
    return fit_nonneg(ext[:, :3], ext[:, 3]), fit_nonneg(dec[:, :3], dec[:, 3])


def run_profile(cfg: EngineConfig, quick: bool, backend: Backend, log=print,
                plan: dict[str, Any] | None = None, serving: bool = True,
                serving_pd: bool = True) -> Profile:
    """Measure and fit; `plan` overrides the QUICK/FULL point lists (tests use a tiny one).
    `serving_pd=False` skips the 1P1D stack of the serving overheads (a profile only for
    colocated nodes: the PD figures stay unset)."""
    plan = plan or (QUICK if quick else FULL)
    from pdserve.plan.profile_transfer import measure_transfer

    log(f"profiling {cfg.model} (page size {cfg.page_size}) with the real engine")
    from pdserve.plan.profile_contention import runnable_now

    load, before = os.getloadavg()[0], runnable_now()
    info, _ = measure_engine(cfg, plan, log)
    background = (before + runnable_now()) / 2
    prefill, decode = fit_steps(info)
    log(f"  KV transfer ({backend}) between two processes")
    tx = measure_transfer(info["layout"], cfg.page_size, cfg.model, backend,
                          plan["transfer_sizes"], plan["transfer_reps"])
    prof = Profile(
        model=cfg.model, page_size=cfg.page_size, engine=asdict(cfg),
        kv_bytes_per_token=info["bytes_per_token"], kv_pool_tokens=info["pool_tokens"],
        torch_threads=int(info["describe"]["torch_threads"]), cpu_count=os.cpu_count() or 1,
        transfer_backend=backend, prefill_coef=prefill, decode_coef=decode,
        transfer_latency_s=tx["latency_s"], transfer_gbps=tx["gbps"],
        contention=info["contention"], background_load=round(background, 2),
        points={"extend": info["extend"], "decode": info["decode"],
                "transfer": tx["points"], "engine": info["describe"],
                "loadavg": [load, os.getloadavg()[0]]})
    if serving:
        from pdserve.plan.profile_http import measure_overheads

        log("  serving overheads through a real `pdserve serve` node"
            + " and a 1P1D stack" * serving_pd)
        over = measure_overheads(cfg, prof, backend, pd=serving_pd)
        # served steps faster than the engine profile's: it was disturbed (profile_http.py)
        prof.prefill_coef = [c * over["prefill_scale"] for c in prof.prefill_coef]
        prof.decode_coef = [c * over["decode_scale"] for c in prof.decode_coef]
        prof.request_overhead_s = over["request_overhead_s"]
        prof.step_overhead_s = over["step_overhead_s"]
        prof.pd_request_overhead_s = over.get("pd_request_overhead_s")
        prof.pd_step_overhead_s = over.get("pd_step_overhead_s")
        prof.request_jitter_s = over["request_jitter_s"]
        prof.pd_request_jitter_s = over.get("pd_request_jitter_s", [])
        prof.tpot_jitter_s = over["tpot_jitter_s"]
        prof.pd_tpot_jitter_s = over.get("pd_tpot_jitter_s", [])
        prof.points["serving"] = over
    return prof
