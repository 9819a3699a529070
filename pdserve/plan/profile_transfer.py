"""KV transfer bandwidth between two real processes with `kv_transfer` (mooncake or tcp).

The parent is the prefill side and the spawned child the decode side; each registers
per-layer K/V buffers of the profiled model's layout. A transfer of n tokens is timed from
`KVSender.send` until the sender reports Success (every byte written and acknowledged), for
a few sizes; `latency + bytes / bandwidth` is fitted to the medians.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import time

import numpy as np

from kv_transfer.config import Backend

META_BYTES = 32  # one metadata row (docs/architecture.md: PD bookkeeping)


def _buffers(tokens: int, layers: int, heads: int, head_dim: int, dtype: str):
    import torch

    dt = getattr(torch, dtype)
    k = [torch.zeros(tokens, heads, head_dim, dtype=dt) for _ in range(layers)]
    v = [torch.zeros(tokens, heads, head_dim, dtype=dt) for _ in range(layers)]
    return k, v, [torch.zeros(8, META_BYTES, dtype=torch.uint8)]


def _args(bufs, page_size: int, model: str):
    from kv_transfer import KVArgs

    return KVArgs.from_tensors(bufs[0], bufs[1], page_size, model, bufs[2])


def _decode_child(conn, shape: tuple, page_size: int, model: str, backend: Backend
                  ) -> None:
    from kv_transfer import KVReceiver, KVTransferConfig, TransferManager

    bufs = _buffers(*shape)
    mgr = TransferManager(_args(bufs, page_size, model), "decode",
                          KVTransferConfig(backend=backend))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            room, endpoint, pages = msg
            r = KVReceiver(mgr, room, endpoint)
            r.init(pages, 0)
            deadline = time.monotonic() + 60
            while not r.poll().terminal and time.monotonic() < deadline:
                time.sleep(0.0002)
            conn.send(int(r.poll()))
    finally:
        mgr.close()


def measure_transfer(layout, page_size: int, model: str, backend: Backend,
                     sizes: list[int], reps: int) -> dict:
    """`layout`: (layers, kv heads, head dim, dtype name). Returns the fit and the points."""
    from kv_transfer import KVPoll, KVSender, KVTransferConfig, TransferManager

    tokens = max(sizes) + page_size
    shape = (tokens, *layout)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_child, args=(child, shape, page_size, model, backend),
                       daemon=True)
    proc.start()
    bufs = _buffers(*shape)
    mgr = TransferManager(_args(bufs, page_size, model), "prefill",
                          KVTransferConfig(backend=backend))
    bytes_per_token = 2 * layout[0] * layout[1] * layout[2] * bufs[0][0].element_size()
    points, rng = [], random.Random(0)
    try:
        for n in sizes:
            pages = list(range(-(-n // page_size)))
            times = []
            for rep in range(reps + 1):  # the first of each size warms up
                room = rng.getrandbits(63)
                parent.send((room, mgr.endpoint, pages))
                s = KVSender(mgr, room)
                while s.poll() < KVPoll.WaitingForInput:
                    if s.poll() == KVPoll.Failed:
                        raise RuntimeError(f"KV transfer failed: {s.failure_reason}")
                    time.sleep(0.0002)
                s.init(len(pages), 0)
                t0 = time.perf_counter()
                s.send(pages, last=True, metadata=b"\0" * META_BYTES)
                while not s.poll().terminal:
                    time.sleep(0.0002)
                dt = time.perf_counter() - t0
                if not parent.poll(60) or parent.recv() != KVPoll.Success:
                    raise RuntimeError("KV transfer failed on the receiving process")
                if rep:
                    times.append(dt)
            points.append({"tokens": len(pages) * page_size,
                           "bytes": len(pages) * page_size * bytes_per_token,
                           "median_s": statistics.median(times)})
    finally:
        mgr.close()
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    x = np.array([[1.0, p["bytes"]] for p in points])
    y = np.array([p["median_s"] for p in points])
    from pdserve.plan.profile_model import fit_nonneg

    lat, per_byte = fit_nonneg(x, y)
    gbps = 1.0 / per_byte / 1e9 if per_byte > 0 else max(p["bytes"] for p in points) / 1e9 / max(
        y.max() - lat, 1e-6)
    return {"latency_s": lat, "gbps": gbps, "bytes_per_token": bytes_per_token,
            "points": points}
