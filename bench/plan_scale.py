"""Simulator speed at scale: one hour of traffic at 10,000 req/s over 500 nodes (250P250D).

- fast simulator (`pdserve/plan/sim_fast.py`, its segment groups in `--workers` forked
  processes, default one per core) over `--seconds` simulated seconds (full run: the whole
  hour; `--quick`: 300 s, projected to the hour);
- both simulators on the same first `--check-seconds` of that traffic: their p50/p90 TTFT
  and TPOT side by side (the reference is `pdserve/plan/sim.py`, one heap event per step)
  and the reference's projected wall time for the hour.
Costs are a fixed GPU-like profile (prefill 20k tok/s, decode step 15 ms + 0.1 ms per
request), so the figures do not depend on this machine's model speed; wall times do
depend on its load (reported, with the simulator's CPU seconds, which do not wait for
other processes). Prompts uniform 64..512 tokens, outputs uniform 8..64.

    python bench/plan_scale.py [--quick] [--out bench/out/plan_scale.json]
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve.plan.profile_model import Profile  # noqa: E402
from pdserve.plan.search import node_spec  # noqa: E402
from pdserve.plan.sim import ClusterSpec, Simulator  # noqa: E402
from pdserve.plan.sim_fast import FastSimulator  # noqa: E402
from pdserve.plan.workload import synthetic  # noqa: E402

RATE, NODES = 10_000.0, 500


def reference_profile(model: str = "tiny-llama") -> Profile:
    """GPU-like round numbers: prefill 20k tok/s, decode step 15 ms + 0.1 ms/request,
    25 GB/s transfer, 500k KV tokens per node (only the simulator's speed is measured)."""
    return Profile(model=model, page_size=16, engine={"max_running_requests": 256},
                   kv_bytes_per_token=65536, kv_pool_tokens=500_000, torch_threads=1,
                   cpu_count=1, transfer_backend="mooncake", prefill_coef=[0.01, 5e-5, 0.0],
                   decode_coef=[0.015, 1e-4, 1e-5], transfer_latency_s=0.001,
                   transfer_gbps=25.0)


def cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the simulator's workers)."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                 resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_one(kind: str, seconds: float, seed: int = 1, workers: int = 0) -> dict:
    prof = reference_profile()
    wl = synthetic(RATE, int(RATE * seconds), "uniform:64:512", "uniform:8:64", seed=seed)
    cluster = ClusterSpec(prefill=NODES // 2, decode=NODES // 2, node=node_spec(prof))
    sim = (FastSimulator(prof, cluster, workers=workers) if kind == "fast"
           else Simulator(prof, cluster))
    load = os.getloadavg()[0]
    cpu0 = cpu_s()
    res = sim.run(wl)
    cpu = cpu_s() - cpu0
    stat = {f"{m}_p{q}_ms": round(1e3 * float(np.nanpercentile(getattr(res, m), q)), 2)
            for m in ("ttft", "tpot") for q in (50, 90)}
    return {"simulator": kind, "sim_seconds": round(res.duration, 1), "requests": len(wl),
            "wall_s": round(res.wall_s, 2), "wall_per_sim_hour_s": round(
                res.wall_s / max(res.duration, 1e-9) * 3600, 1),
            "cpu_s": round(cpu, 2), "cpu_per_sim_hour_s": round(
                cpu / max(res.duration, 1e-9) * 3600, 1),
            "stable": res.stable, **stat, "busy_prefill": round(res.busy_frac["prefill"], 3),
            "busy_decode": round(res.busy_frac["decode"], 3),
            "max_decode_batch": getattr(sim, "max_batch", None), "loadavg_1m": round(load, 2)}


def measure(seconds: float, check_seconds: float, workers: int = 0
            ) -> tuple[dict, list[dict]]:
    """The rows (reference and fast on the check slice, fast on `seconds`) and a summary."""
    t0 = time.monotonic()
    rows = [run_one("reference", check_seconds), run_one("fast", check_seconds),
            run_one("fast", seconds, workers=workers)]
    ref, fast_slice, fast = rows
    agree = {k: round(abs(fast_slice[k] - ref[k]) / ref[k], 3)
             for k in ref if k.endswith("_ms") and ref[k]}
    summary = {
        "nodes": NODES, "rate": RATE, "sim_seconds": fast["sim_seconds"],
        "workers": workers or os.cpu_count(),
        "requests": fast["requests"], "wall_s": fast["wall_s"],
        "projected_wall_s_for_1h": fast["wall_per_sim_hour_s"],
        "under_1_min": fast["wall_per_sim_hour_s"] < 60,
        # CPU time does not grow with other processes' load the way wall time does: the
        # wall time on an idle machine is about cpu / workers (the groups are balanced)
        "cpu_per_sim_hour_s": fast["cpu_per_sim_hour_s"],
        "measured_full_hour": fast["sim_seconds"] >= 3600,
        "reference_projected_wall_s_for_1h": ref["wall_per_sim_hour_s"],
        "fast_vs_reference_rel_diff": agree, "check_seconds": check_seconds,
        "max_rss_mb": max(resource.getrusage(w).ru_maxrss for w in (
            resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) // 1024,  # largest process
        "loadavg_after": os.getloadavg(), "bench_wall_s": round(time.monotonic() - t0, 1)}
    return summary, rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--check-seconds", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=0,
                        help="fast simulator processes (0: one per core)")
    args = parser.parse_args()
    args.seconds = args.seconds or (300.0 if args.quick else 3600.0)
    args.check_seconds = args.check_seconds or (3.0 if args.quick else 10.0)
    load_before = os.getloadavg()
    summary, rows = measure(args.seconds, args.check_seconds, args.workers)
    summary["loadavg_before"] = load_before
    print_table(rows, ["simulator", "sim_seconds", "requests", "wall_s", "wall_per_sim_hour_s",
                       "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "stable",
                       "loadavg_1m"])
    print("summary:", summary)
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
