"""Search the cluster shapes (xPyD and colocated N) that meet the SLOs at the least cost.

Candidates are simulated in order of cost (node count weighted by `--node-cost`); the
search stops after the first cost level at which some shape meets every SLO, plus one more
level so the table shows the runners-up. A shape "meets" when the run stays stable and each
`--slo` percentile is within its limit; attainment is the fraction of requests within every
limit (DistServe's per-request SLO attainment); goodput counts those per second and node.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from pdserve.plan.profile_model import Profile
from pdserve.plan.sim import ClusterSpec, SimResult
from pdserve.plan.sim_fast import simulator_for
from pdserve.plan.sim_node import NodeSpec
from pdserve.plan.workload import Workload

SLO_RE = re.compile(r"^(ttft|tpot|e2e)_(p\d{1,2}(?:\.\d+)?|mean)$")


def parse_slos(items: list[str]) -> dict[str, float]:
    """`ttft_p90:500 tpot_p90:50` -> {"ttft_p90": 0.5, "tpot_p90": 0.05} (seconds)."""
    out: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        if not SLO_RE.match(key):
            raise ValueError(f"unknown SLO key {key!r}: use ttft|tpot|e2e with _pNN or _mean, "
                             "e.g. ttft_p90:500 tpot_p90:50 (milliseconds)")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: the limit must be a number of ms") from None
        if not ms > 0 or not math.isfinite(ms):
            raise ValueError(f"SLO {item!r}: the limit must be > 0 ms")
        out[key] = ms / 1000.0
    if not out:
        raise ValueError("give at least one --slo, e.g. ttft_p90:500")
    return out


def stat(values: np.ndarray, which: str) -> float:
    """Percentile or mean in seconds; requests without a value count as infinitely late."""
    v = np.where(np.isnan(values), np.inf, values)
    if which == "mean":
        return float(np.mean(v))
    return float(np.percentile(v, float(which[1:]), method="higher"))


@dataclass
class Outcome:
    cluster: ClusterSpec
    cost: float
    meets: bool
    attainment: float
    goodput_per_node: float
    stats: dict  # "ttft_p50" ... in ms
    stable: bool
    busy: dict

    def row(self) -> dict:
        return {"shape": self.cluster.label(), "nodes": self.cluster.nodes, "cost": self.cost,
                "meets": self.meets, "attain": round(self.attainment, 3),
                "goodput/node": round(self.goodput_per_node, 3),
                **{k: round(v, 1) for k, v in self.stats.items()}}


def _per_request(res: SimResult, wl: Workload, metric: str) -> np.ndarray:
    """Seconds per request, inf where the request did not finish; TPOT only over requests
    with more than one output token."""
    vals = {"ttft": res.ttft, "tpot": res.tpot, "e2e": res.e2e}[metric]
    vals = np.where(np.isnan(res.e2e) | np.isnan(vals), np.inf, vals)
    return vals[wl.osl > 1] if metric == "tpot" else vals


def evaluate(res: SimResult, wl: Workload, cluster: ClusterSpec, cost: float,
             slos: dict[str, float]) -> Outcome:
    keys = ["ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", *slos]
    stats = {}
    for key in dict.fromkeys(keys):
        m, p = key.split("_", 1)
        stats[key] = 1e3 * stat(_per_request(res, wl, m), p)
    ok = res.stable and all(stats[k] <= limit * 1e3 for k, limit in slos.items())
    good = np.ones(len(wl), dtype=bool)
    for key, limit in slos.items():
        m = key.split("_", 1)[0]
        vals = {"ttft": res.ttft, "tpot": res.tpot, "e2e": res.e2e}[m]
        if m == "tpot":  # a one-token output has no TPOT: only its finishing counts
            vals = np.where(wl.osl > 1, vals, 0.0)
        good &= np.where(np.isnan(res.e2e) | np.isnan(vals), np.inf, vals) <= limit
    span = max(float(wl.arrival[-1] - wl.arrival[0]), 1e-9)
    return Outcome(cluster, cost, bool(ok), float(good.mean()),
                   float(good.sum() / span / cluster.nodes), stats, res.stable, res.busy_frac)


def node_spec(prof: Profile) -> NodeSpec:
    e = prof.engine_knobs()
    return NodeSpec(page_size=prof.page_size, pool_pages=prof.kv_pool_tokens // prof.page_size,
                    chunk=int(e["chunked_prefill_size"]), budget=int(e["max_prefill_tokens"]),
                    max_running=int(e["max_running_requests"]),
                    reserve_tokens=int(e["decode_reserve_tokens"]),
                    mix=not e["disable_mixed_batches"])


def candidates(max_nodes: int, cost: dict[str, float], base: ClusterSpec) -> list[tuple]:
    out = [(cost["colocated"] * n, replace(base, prefill=0, decode=0, colocated=n))
           for n in range(1, max_nodes + 1)]
    out += [(cost["prefill"] * x + cost["decode"] * y, replace(base, prefill=x, decode=y))
            for x in range(1, max_nodes) for y in range(1, max_nodes - x + 1)]
    return sorted(out, key=lambda c: (c[0], c[1].nodes, c[1].colocated == 0))


def search(prof: Profile, wl: Workload, slos: dict[str, float], max_nodes: int,
           cost: dict[str, float], base: ClusterSpec, seed: int = 0,
           log=None, workers: int = 1) -> list[Outcome]:
    """Every evaluated shape, best first (meets, then cost, then attainment)."""
    results: list[Outcome] = []
    levels_after = None
    for c, cluster in candidates(max_nodes, cost, base):
        if levels_after is not None and c > levels_after:
            break
        res = simulator_for(prof, cluster, wl, seed, workers).run(wl)
        out = evaluate(res, wl, cluster, c, slos)
        results.append(out)
        if log:
            log(f"  {cluster.label():>8}  cost {c:g}  {'meets' if out.meets else 'misses'}")
        if out.meets and levels_after is None:
            higher = sorted({cc for cc, _ in candidates(max_nodes, cost, base) if cc > c})
            levels_after = higher[0] if higher else c
    return sorted(results, key=lambda o: (not o.meets, o.cost, -o.attainment))


def verdict(results: list[Outcome], slos: dict[str, float]) -> str:
    pd = [o for o in results if o.cluster.pd]
    co = [o for o in results if not o.cluster.pd]
    best_pd = next((o for o in pd if o.meets), None)
    best_co = next((o for o in co if o.meets), None)
    if best_pd is None and best_co is None:
        return ("no shape within --max-nodes meets the SLOs; raise --max-nodes, relax the "
                "SLOs or lower the rate")
    if best_co is None or (best_pd is not None and best_pd.cost < best_co.cost):
        assert best_pd is not None  # not both None (above)
        same = max((o for o in co if o.cost <= best_pd.cost), key=lambda o: o.attainment,
                   default=None)
        why = ""
        if same is not None:
            missed = [k for k, v in slos.items() if same.stats[k] > v * 1e3]
            why = (f"; colocated at that cost ({same.cluster.label()}) misses "
                   f"{', '.join(missed) or 'stability'}" + (
                       ": its prefill batches stall the running decodes" if any(
                           k.startswith("tpot") for k in missed) else ""))
        return f"disaggregation wins: {best_pd.cluster.label()} (cost {best_pd.cost:g}){why}"
    if best_pd is None or best_co.cost < best_pd.cost:
        tail = (f" vs {best_pd.cluster.label()} (cost {best_pd.cost:g})" if best_pd else
                " and no xPyD within --max-nodes does")
        return (f"colocation wins: {best_co.cluster.label()} (cost {best_co.cost:g}) meets "
                f"the SLOs{tail}; at this load prefill interference is small and a split "
                "pays a KV transfer and leaves capacity idle in one tier")
    return (f"tie at cost {best_co.cost:g}: {best_co.cluster.label()} and "
            f"{best_pd.cluster.label()} both meet the SLOs; colocation is simpler")
