"""`pdserve profile` and `pdserve plan` (docs/architecture.md: Capacity planning).
Only argparse and the configs load at import time."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.plan.config import PlanConfig, ProfileConfig

PLAN_HELP = {
    "profile": "profile JSON written by `pdserve profile`",
    "slo": "SLOs in ms, e.g. ttft_p90:500 tpot_p90:50 (keys: ttft|tpot|e2e _pNN or _mean)",
    "rate": "request rate (req/s); with --trace, rescale the trace to it (0: as recorded)",
    "trace": "trace JSONL: `pdserve bench` output, or Mooncake-style lines with "
             "timestamp (ms), input_length, output_length (CSV with that header works)",
    "isl": "prompt lengths: N, uniform:LO:HI, normal:MEAN:STD or lognormal:MEAN:SIGMA",
    "osl": "output lengths, same forms as --isl",
    "burstiness": "gamma arrivals: 1 = Poisson, < 1 burstier",
    "num_requests": "requests simulated per shape (synthetic workloads)",
    "max_nodes": "largest cluster searched (nodes of all kinds)",
    "node_cost": "cost per node kind, e.g. prefill:2 decode:1 colocated:2 (default 1 each)",
    "model": "refuse a profile of another model",
    "page_size": "refuse a profile measured with another page size (0: any)",
    "machine_cores": "model every node sharing one machine of this many cores (0: a machine "
                     "per node)",
    "node_threads": "torch threads per node for --machine-cores (0: the profile's)",
    "background_load": "with --machine-cores: runnable threads of other processes on that "
                       "machine (e.g. its load average before the stack starts)",
    "transfer_backend": "transfer.backend in --values-out (default: the profile's)",
    "values_out": "write Helm values for helm/pdserve (the best xPyD shape)",
    "plot": "PNG of SLO attainment vs rate for the best shapes",
    "out": "write the ranked shapes and the verdict as JSON (top-level `summary`)",
    "top": "rows of the printed table",
    "seed": "seed of arrivals, lengths and router ties",
    "sim_workers": "processes of the fast simulator (long PD workloads; 0: one per core)",
}


def add_parser(sub) -> None:
    prof = sub.add_parser("profile", help="measure one node (prefill, decode, KV transfer, "
                          "KV capacity) with the real engine; write a profile JSON")
    EngineConfig.add_cli_args(prof)
    prof.add_argument("--out", default="profile.json", help="profile JSON to write")
    prof.add_argument("--quick", action="store_true", help="fewer points (~1 min, tiny-llama)")
    prof.add_argument("--transfer-backend", default="tcp", choices=["tcp", "mooncake"],
                      help="KV transfer backend measured between two processes")
    prof.add_argument("--skip-serving", action="store_true",
                      help="do not start a `pdserve serve` node to measure the HTTP and "
                      "per-step serving overheads (they are then 0)")
    prof.set_defaults(func=run_profile)

    plan = sub.add_parser("plan", help="simulate xPyD and colocated shapes on a profile; "
                          "recommend the cheapest that meets the SLOs")
    for f in fields(PlanConfig):
        flag = "--" + f.name.replace("_", "-")
        kw: dict = {"help": PLAN_HELP[f.name], "default": f.default}
        if f.name in ("slo", "node_cost"):
            kw.update(nargs="+", default=list(f.default) if f.name == "node_cost" else None,
                      required=f.name == "slo")
        elif f.name == "profile":
            kw.update(required=True, default=None)
        else:
            kw["type"] = type(f.default)
        plan.add_argument(flag, **kw)
    plan.set_defaults(func=run_plan)


def _fail(cmd: str, exc: Exception) -> int:
    print(f"pdserve {cmd}: error: {exc}", file=sys.stderr)
    return 2


def run_profile(args: argparse.Namespace) -> int:
    try:
        cfg = ProfileConfig(EngineConfig.from_cli(args), args.out, args.quick,
                            args.transfer_backend)
    except ValueError as exc:
        return _fail("profile", exc)
    from pdserve.plan.profile import run_profile as run

    prof = run(cfg.engine, cfg.quick, cfg.transfer_backend, serving=not args.skip_serving)
    prof.save(cfg.out)
    p, d = prof.prefill_coef, prof.decode_coef
    print(f"prefill step = {1e3 * p[0]:.2f} ms + {1e3 * p[1]:.4f} ms/token "
          f"+ {1e3 * p[2]:.3f} ms per 1e6 attention pairs")
    print(f"decode step  = {1e3 * d[0]:.2f} ms + {1e3 * d[1]:.3f} ms/request "
          f"+ {1e3 * d[2]:.4f} ms per 1k context tokens")
    print(f"KV transfer  = {1e3 * prof.transfer_latency_s:.2f} ms + "
          f"{prof.transfer_gbps:.2f} GB/s; KV pool {prof.kv_pool_tokens} tokens "
          f"({prof.kv_bytes_per_token} B/token)")
    print(f"serving      = {1e3 * prof.request_overhead_s:.2f} ms per request + "
          f"{1e3 * prof.step_overhead_s:.2f} ms per step (colocated node)")
    if prof.pd_request_overhead_s is not None:
        print(f"serving (PD) = {1e3 * prof.pd_request_overhead_s:.2f} ms per request + "
              f"{1e3 * (prof.pd_step_overhead_s or 0.0):.2f} ms per decode step "
              "(1P1D stack behind the router)")
    print(f"wrote {cfg.out}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    try:
        cfg = PlanConfig(**{f.name: tuple(getattr(args, f.name)) if f.name in (
            "slo", "node_cost") else getattr(args, f.name) for f in fields(PlanConfig)})
        from pdserve.plan.planner import prepare

        job = prepare(cfg)
    except ValueError as exc:  # ProfileError is a ValueError
        return _fail("plan", exc)
    from pdserve.plan.planner import execute

    report = execute(cfg, job)
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {cfg.out}")
    return 0
