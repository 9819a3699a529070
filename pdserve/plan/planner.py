"""`pdserve plan`: validate everything first (`prepare`), then search, print, write."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdserve.plan.config import PlanConfig
from pdserve.plan.profile_model import Profile
from pdserve.plan.search import Outcome, evaluate, node_spec, parse_slos, search, verdict
from pdserve.plan.sim import ClusterSpec
from pdserve.plan.sim_fast import simulator_for
from pdserve.plan.workload import Workload, load_trace, parse_dist, synthetic

PLOT_RATES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


@dataclass
class Job:
    prof: Profile
    slos: dict[str, float]
    wl: Workload
    base: ClusterSpec
    costs: dict[str, float]


def workload_at(cfg: PlanConfig, rate: float) -> Workload:
    if cfg.trace:
        wl = load_trace(cfg.trace)
        return wl.scaled(rate) if rate > 0 else wl
    return synthetic(rate, cfg.num_requests, cfg.isl, cfg.osl, cfg.burstiness, cfg.seed)


def prepare(cfg: PlanConfig) -> Job:
    """Every input check, before any simulation; raises ValueError with the reason."""
    slos = parse_slos(list(cfg.slo))
    if not cfg.trace:
        parse_dist(cfg.isl)
        parse_dist(cfg.osl)
    prof = Profile.load(cfg.profile)
    prof.expect(cfg.model or None, cfg.page_size or None)
    wl = workload_at(cfg, cfg.rate)
    longest = int((wl.isl + wl.osl).max())
    if longest > prof.kv_pool_tokens:
        raise ValueError(f"a request needs {longest} KV tokens but a node's pool holds "
                         f"{prof.kv_pool_tokens} (profile with a larger --kv-cache-mb)")
    base = ClusterSpec(node=node_spec(prof), machine_cores=cfg.machine_cores,
                       node_threads=cfg.node_threads or prof.torch_threads,
                       background_load=cfg.background_load)
    return Job(prof, slos, wl, base, cfg.costs())


def execute(cfg: PlanConfig, job: Job) -> dict:
    wl = job.wl
    print(f"workload: {len(wl)} requests at {wl.rate:.3g} req/s, prompt mean "
          f"{wl.isl.mean():.0f}, output mean {wl.osl.mean():.0f} tokens; profile "
          f"{job.prof.model} (page {job.prof.page_size})")
    results = search(job.prof, wl, job.slos, cfg.max_nodes, job.costs, job.base, cfg.seed,
                     workers=cfg.sim_workers)
    rows = [o.row() for o in results]
    _print_table(rows[: cfg.top])
    text = verdict(results, job.slos)
    print(f"\nverdict: {text}")
    best = results[0] if results and results[0].meets else None
    report: dict[str, Any] = {"summary": {"best": best.row() if best else None, "verdict": text,
                          "slo_ms": {k: v * 1e3 for k, v in job.slos.items()},
                          "rate": wl.rate, "requests": len(wl), "profile": cfg.profile},
              "rows": rows}
    if cfg.values_out:
        report["summary"]["values"] = _write_values(cfg, job, results, text)
    if cfg.plot:
        _plot(cfg, job, results)
    return report


def _print_table(rows: list[dict]) -> None:
    cols = ["shape", "cost", "meets", "attain", "goodput/node", "ttft_p50", "ttft_p90",
            "tpot_p50", "tpot_p90"]
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(width[c]) for c in cols) + "   (latencies in ms)")
    for r in rows:
        print("  ".join(str(r[c]).rjust(width[c]) for c in cols))


def _best(results: list[Outcome], pd: bool) -> Outcome | None:
    group = [o for o in results if o.cluster.pd == pd]
    return next((o for o in group if o.meets), None) or max(
        group, key=lambda o: o.attainment, default=None)


def _write_values(cfg: PlanConfig, job: Job, results: list[Outcome], text: str) -> str:
    from pdserve.plan.helm_values import plan_values, write_values

    pd = _best(results, pd=True)
    if pd is None:  # only colocated shapes were evaluated: take the cheapest 1P1D
        pd = Outcome(replace(job.base, prefill=1, decode=1), 0, False, 0, 0, {}, False, {})
    values = plan_values(job.prof, pd.cluster, cfg.transfer_backend or job.prof.transfer_backend)
    note = "meets the SLOs" if pd.meets else "does NOT meet the SLOs (best xPyD found)"
    header = (f"pdserve plan: {pd.cluster.label()} {note}\nverdict: {text}\n"
              f"profile: {cfg.profile}; SLOs: {' '.join(cfg.slo)}")
    write_values(cfg.values_out, values, header)
    print(f"wrote {cfg.values_out} ({pd.cluster.label()})")
    return cfg.values_out


def _plot(cfg: PlanConfig, job: Job, results: list[Outcome]) -> None:
    from pdserve.plan.plot import attainment_plot

    rate = job.wl.rate
    curves = {}
    for o in (_best(results, pd=True), _best(results, pd=False)):
        if o is None:
            continue
        pts = []
        for f in PLOT_RATES:
            wl = workload_at(cfg, rate * f)
            res = simulator_for(job.prof, o.cluster, wl, cfg.seed, cfg.sim_workers).run(wl)
            pts.append((wl.rate, evaluate(res, wl, o.cluster, o.cost, job.slos).attainment))
        curves[o.cluster.label()] = pts
    attainment_plot(cfg.plot, curves, rate, f"{job.prof.model}: SLO {' '.join(cfg.slo)}")
    print(f"wrote {cfg.plot}")
