"""The serving path's own cost, measured through a real `pdserve serve` node.

A node adds work the in-process engine profile does not see: HTTP, tokenizer-free request
validation, the ZMQ hop to the scheduler process, per-step token emission and
detokenization. Two request kinds, sent one at a time (best of `reps`, noise only adds):
- 1 output token: latency = request overhead + one extend step;
- 1 + n output tokens: n more decode steps, each = profiled decode step + step overhead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from pdserve.config import EngineConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_flags(cfg: EngineConfig) -> list[str]:
    keys = ("model", "dtype", "page_size", "max_running_requests", "kv_cache_mb",
            "max_total_tokens", "chunked_prefill_size", "max_prefill_tokens", "loop",
            "decode_reserve_tokens")
    out = []
    for k in keys:
        out += ["--" + k.replace("_", "-"), str(getattr(cfg, k))]
    return out


def _best(client: httpx.Client, url: str, ids: list[int], new: int, reps: int) -> float:
    best = float("inf")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0,
                                                  "ignore_eos": True}}
    for _ in range(reps + 1):  # the first one warms up
        t0 = time.perf_counter()
        r = client.post(f"{url}/generate", json=body)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        best = min(best, dt)
    return best


def measure_overheads(cfg: EngineConfig, prof, prompt: int = 32, new: int = 32,
                      reps: int = 5, timeout_s: float = 300) -> dict:
    """Start a node, time the two request kinds, stop it; returns both overheads (s)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", *_engine_flags(cfg),
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("`pdserve serve` exited while starting")
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("`pdserve serve` did not become healthy")
                time.sleep(0.5)
            ids = [100 + i for i in range(prompt)]
            one = _best(client, url, ids, 1, reps)
            many = _best(client, url, ids, 1 + new, reps)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    request = max(0.0, one - prof.extend_s(prompt, prompt * prompt))
    per_step = (many - one) / new
    ctx = prompt * new + new * (new + 1) / 2
    step = max(0.0, per_step - prof.decode_s(1, ctx / new))
    return {"request_overhead_s": request, "step_overhead_s": step,
            "one_token_s": one, "tokens_s": many}
