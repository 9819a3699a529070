"""The serving path's own cost, measured through real processes the way clients see it.

The in-process engine profile sees only `Engine.step()`. A served request also pays, and
`bench/plan_accuracy.py`'s stage trace of a 1P1D stack on tiny-llama showed these to be
most of a short request's TTFT (median of 20 single requests at load ~2; ~20 ms of the
~29 ms minimum TTFT were not compute):
- colocated node: HTTP in, the ZMQ hop to the scheduler process, and per emitted token
  the scheduler loop's emit, detokenization and an SSE line;
- PD stack (router + 1 prefill + 1 decode): the router's HTTP in and its two legs, the
  decode leg's registry lookup, pre-allocation and the control message to the prefill
  (whose forward runs meanwhile; its KV waits for it), the commit on the decode node, and
  every token through the decode node's HTTP process, the router and back to the client;
  on a machine whose cores the forward fills, that per-token work also slows each step.
Each path gets 16 streaming requests one at a time, sent and timed by `pdserve bench`'s own
client (`loadtest.client.send_request`: its per-token parsing is part of what a bench run
measures, ~0.2-0.3 ms a token more than a bare reader on this machine); the medians
(`_typical`) less what the fitted step and transfer models explain become the overheads
(docs/architecture.md: Capacity planning):
- `step_overhead_s` / `pd_step_overhead_s`: TPOT minus the profiled decode step
  (colocated node / decode node of the PD stack);
- `request_overhead_s`: colocated TTFT minus one extend step (with its step overhead);
- `pd_request_overhead_s`: PD TTFT minus the simulator's own path for an idle stack
  (the extend step, started on arrival, or the handshake when that is longer: the
  prefill node's default early start; then the KV transfer of the prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile

import httpx

from pdserve.config import EngineConfig
from pdserve.loadtest.backends import RequestSpec
from pdserve.loadtest.client import send_request
from pdserve.loadtest.dataset import Prompt
from pdserve.ports import wait_serving


def _command(proc: subprocess.Popen) -> str:
    """`pdserve router` or the like: the two words after `python -m`."""
    return " ".join(str(a) for a in list(proc.args)[2:4])  # type: ignore[arg-type]


def _engine_flags(cfg: EngineConfig, model: bool = True) -> list[str]:
    keys = ("model",) * model + ("dtype", "page_size", "max_running_requests", "kv_cache_mb",
            "max_total_tokens", "chunked_prefill_size", "max_prefill_tokens", "loop",
            "decode_reserve_tokens", "threads")
    out = []
    for k in keys:
        out += ["--" + k.replace("_", "-"), str(getattr(cfg, k))]
    return out


async def _streams(url: str, prompts: list[list[int]], new: int) -> list[tuple[float, float]]:
    """(TTFT, TPOT) of each prompt's streaming `/generate` request, one after the other,
    as `pdserve bench` sends and times them."""
    spec = RequestSpec(backend="generate", model="", temperature=0.0, ignore_eos=True)
    out = []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for ids in prompts:
            r = await send_request(client, f"{url}/generate", spec,
                                   Prompt(len(ids), new, ids=tuple(ids)), 0.0, 60)
            if not r.success or r.tpot is None:
                raise RuntimeError(f"{url}: a {new}-token stream failed: "
                                   f"{r.error or f'{r.output_len} tokens'}")
            out.append((r.ttft, r.tpot))
    return out


def _typical(url: str, ids: list[int], new: int,
             reps: int) -> tuple[float, float, list[float], list[float]]:
    """Median TTFT and TPOT over `reps` requests (after one warm-up), every TTFT and every
    TPOT.
    Not the least: the path's own jitter (2 ms polls on both nodes, three event loops)
    is part of every request, so the best of 8 PD TTFTs was half the bench's p50 on a
    quiet machine; and the router sometimes passes a late first token with the next
    ones, which shortens that stream's TPOT below any decode step.
    Each request's prompt is `ids` rotated by its index: no two share a first page, so
    none is served from the prefix cache (a workload's prompts are not either)."""
    prompts = [ids] + [ids[r + 1:] + ids[:r + 1] for r in range(reps)]
    runs = asyncio.run(_streams(url, prompts, new))[1:]  # the first one warms up
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
            sorted(r[0] for r in runs), sorted(r[1] for r in runs))


def _round_trips(client: httpx.Client, url: str) -> bool:
    """Ready = a real request round-trips (a router is up before its nodes)."""
    try:
        r = client.post(f"{url}/generate", json={
            "input_ids": [100, 200, 300], "sampling_params": {"max_new_tokens": 2}})
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def _measure(cmd: list[str], ids: list[int], new: int, reps: int,
             timeout_s: float) -> tuple[float, float, list[float], list[float]]:
    """Start `cmd` (`pdserve serve` or `up`, on a port it picks and writes to a file),
    time the path, stop it and its children."""
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-port-") as folder:
        port_file = os.path.join(folder, "port")
        proc = subprocess.Popen([*cmd, "--port", "0", "--port-file", port_file],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:  # from here on the server is stopped on every way out (its own session:
            # a Ctrl-C here never reaches it)
            with httpx.Client(timeout=60) as client:
                port = wait_serving(proc, port_file, timeout_s, name=f"`{_command(proc)}`",
                                    ready=lambda url: _round_trips(client, url),
                                    stop=_stop, poll_s=0.5)
            return _typical(f"http://127.0.0.1:{port}", ids, new, reps)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to its process group, SIGKILL after 30 s (a group already gone: nothing to
    do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def overheads(prof, prompt: int, new: int, colocated: tuple,
              pd: tuple | None) -> dict:
    """The overheads from measured (TTFT, TPOT) pairs and the profile's step models
    (`prof`'s own overhead fields are ignored: they are what this computes). A third
    item, the measured TTFTs, gives the request jitters: each less the median TTFT; a
    fourth, the measured TPOTs, the token jitters: each less the median TPOT.

    Noise only adds time, and a served request contains the steps the engine profile
    timed: a TPOT below the modelled decode step (a TTFT below the modelled extend step)
    means the engine profile ran while other processes held the cores. Then
    `decode_scale` (`prefill_scale`) < 1 is the factor that brings the model down to the
    served time (the caller scales the coefficients), and that overhead is 0."""
    ctx = prompt + (new - 2) / 2  # mean context of the decode steps, as the simulator counts
    p0, p1, p2 = prof.prefill_coef
    extend = p0 + p1 * prompt + p2 * prompt * prompt / 1e6
    d0, d1, d2 = prof.decode_coef
    decode = d0 + d1 + d2 * ctx / 1e3
    tpot = min(colocated[1], pd[1]) if pd is not None else colocated[1]
    dscale = min(1.0, tpot / decode) if decode > 0 else 1.0
    decode *= dscale
    step = max(0.0, colocated[1] - decode)
    # the TTFT alone bounds the extend step (not less its step overhead: that is measured
    # on other requests, so it is no firmer a bound, and could drive the model to 0)
    pscale = min(1.0, colocated[0] / extend) if extend > 0 else 1.0
    extend *= pscale
    out = {"request_overhead_s": max(0.0, colocated[0] - extend - step), "step_overhead_s": step,
           "colocated_ttft_s": colocated[0], "colocated_tpot_s": colocated[1],
           "prompt": prompt, "new_tokens": new, "decode_scale": dscale,
           "prefill_scale": pscale, "request_jitter_s": _jitter(colocated),
           "tpot_jitter_s": _jitter(colocated, 3)}
    if pd is not None:
        # early start (the nodes' default): the extend step runs while the decode node's
        # pre-allocation is on its way (`sim.py`)
        path = max(prof.transfer_latency_s, extend + step) + prof.transfer_s(prompt)
        out.update(pd_request_overhead_s=max(0.0, pd[0] - path),
                   pd_step_overhead_s=max(0.0, pd[1] - decode),
                   pd_ttft_s=pd[0], pd_tpot_s=pd[1], pd_request_jitter_s=_jitter(pd),
                   pd_tpot_jitter_s=_jitter(pd, 3))
    return out


def _jitter(measured: tuple, item: int = 2) -> list[float]:
    """The measured TTFTs (`item` 2) or TPOTs (3) less their median ([] when they were not
    given)."""
    median = measured[item - 2]
    return [t - median for t in measured[item]] if len(measured) > item else []


def measure_overheads(cfg: EngineConfig, prof, backend: str = "tcp", pd: bool = True,
                      prompt: int = 64, new: int = 32, reps: int = 16,
                      timeout_s: float = 300) -> dict:
    """Colocated node (`pdserve serve`), then with `pd` a 1P1D stack (`pdserve up`): both
    timed with streaming requests; returns `overheads(...)` (seconds)."""
    ids = [100 + i for i in range(prompt)]
    flags = _engine_flags(cfg)
    base = [sys.executable, "-m", "pdserve.cli"]
    colo = _measure([*base, "serve", *flags], ids, new, reps, timeout_s)
    stack = None
    if pd:
        with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as logs:
            cmd = [*base, "up", "--model", cfg.model, "--prefill", "1", "--decode", "1",
                   "--registry-port", "0", "--transfer-backend",
                   backend, "--log-dir", logs, "--node-args",
                   " ".join(_engine_flags(cfg, model=False))]
            stack = _measure(cmd, ids, new, reps, timeout_s)
    return overheads(prof, prompt, new, colo, stack)
