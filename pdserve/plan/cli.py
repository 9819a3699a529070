"""`pdserve profile` and `pdserve plan` (docs/architecture.md: Capacity planning).
Only argparse and the configs load at import time."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.flags import add_dataclass_flags, values_from
from pdserve.plan.config import PlanConfig, ProfileConfig


def add_parser(sub) -> None:
    prof = sub.add_parser("profile", help="measure one node (prefill, decode, KV transfer, "
                          "KV capacity) with the real engine; write a profile JSON")
    EngineConfig.add_cli_args(prof)
    add_dataclass_flags(prof, ProfileConfig, "profile", skip=("engine",))
    prof.set_defaults(func=run_profile)

    plan = sub.add_parser("plan", help="simulate xPyD and colocated shapes on a profile; "
                          "recommend the cheapest that meets the SLOs")
    add_dataclass_flags(plan, PlanConfig, "plan")
    plan.set_defaults(func=run_plan)


def _fail(cmd: str, exc: Exception) -> int:
    print(f"pdserve {cmd}: error: {exc}", file=sys.stderr)
    return 2


def run_profile(args: argparse.Namespace) -> int:
    try:
        cfg = ProfileConfig(EngineConfig.from_cli(args),
                            **values_from(ProfileConfig, args, skip=("engine",)))
    except ValueError as exc:
        return _fail("profile", exc)
    from pdserve.plan.profile import run_profile as run

    prof = run(cfg.engine, cfg.quick, cfg.transfer_backend, serving=not cfg.skip_serving)
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
        cfg = PlanConfig(**values_from(PlanConfig, args))
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
