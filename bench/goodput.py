"""Goodput of colocated vs every xPyD split of the same cores, measured and planned.

Goodput (DistServe's metric) is the highest request rate at which at least `--target`
(90 %) of the requests meet both a TTFT and a TPOT objective. For each configuration —
one colocated node on all `--cores` (`pdserve serve --threads cores`), and each xPyD split
of those cores (`pdserve up --prefill x --decode y --node-threads cores // (x+y)`, what
`pdserve up` gives by default) — and each SLO pair (loose, tight TTFT, tight TPOT):

1. the planner's goodput: `pdserve plan`'s simulator (in-process, the reference event
   simulator with every node sharing this machine's cores, the background load sampled
   just before the configuration's stack starts) on the same requests, found by the same
   search as 2. over the simulated attainment; the profile is `pdserve profile`'s, taken
   at the configuration's forward threads (one profile per thread count);
2. the measured goodput: `bisect_rate` over real `pdserve bench` runs (the load-test
   runner in-process) against the stack, inside a bracket found by halving or doubling
   the rate from the planner's figure (so a planner far off costs runs, not accuracy).
   One run at a rate serves every SLO pair.

Each rate is one run of `n = rate * --probe-s` requests (clamped to [--min-prompts,
--max-prompts]) with Poisson arrivals seeded by `--seed`: the same arrival times in the
simulator and on the wire. Prompts are fresh random tokens on every run (so no run hits
the prefix cache of an earlier one), fixed lengths, `ignore_eos`. A finite run starts
from an idle system, so a rate slightly above capacity can still pass a loose TTFT
objective before its queue grows; both sides see the same window.

On one CPU machine an xPyD split does not add hardware: the nodes share the cores the
colocated node has alone, so each PD step runs on fewer threads. PD can only win where the
colocated node's prefill batches stalling its decodes (TPOT) cost more than that.

    python bench/goodput.py [--quick] [--out bench/out/goodput.json] [--plot bench/out/goodput]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from pdserve.cpus import usable_cores  # noqa: E402
from pdserve.flags import ConfigError, add_dataclass_flags, comma_list, opt, values_from  # noqa: E402

# SLO pairs NAME:TTFT_MS:TPOT_MS per (model, prompt tokens, output tokens), chosen on a
# 2-core Xeon (AMX) with the default dtype (auto: float32 on a CPU). smollm2-135m at
# 256/32 (--quick): at 0.67 req/s one colocated node on 2 threads measured TTFT p50/p90
# 0.5/0.74 s and TPOT p50/p90 93/118 ms, 1P1D (1 thread per node) 0.9/2.3 s and 87/93 ms
# (its prefill steps run 1.6x slower, its decodes without prefill stalls); at 1024/128 the
# profiles put an idle prefill at ~1.4 s (2 threads) / ~2.3 s (1 thread) and a decode step
# at ~70 / ~80 ms. tiny-llama at 512/32: the HTTP path dominates (p90 TTFT ~25 ms
# colocated, ~70 ms PD, p90 TPOT ~5-6 ms: bench/plan_accuracy.py's runs). Loose leaves
# room for queueing (capacity decides); each tight pair holds one metric to a little over
# its idle value, where the two kinds of node differ.
SLO_DEFAULTS: dict[tuple[str, int, int], tuple[str, ...]] = {
    ("smollm2-135m", 1024, 128): ("loose:10000:300", "tight-ttft:3000:300",
                                  "tight-tpot:10000:120"),
    ("smollm2-135m", 256, 32): ("loose:3000:200", "tight-ttft:1000:200", "tight-tpot:3000:100"),
    ("tiny-llama", 512, 32): ("loose:500:50", "tight-ttft:150:50", "tight-tpot:500:15"),
}
# (full, --quick) values of the fields whose 0 / "" means "the mode's default".
MODE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "model": ("smollm2-135m", "smollm2-135m"), "isl": (1024, 256), "osl": (128, 32),
    "probe_s": (30.0, 6.0), "min_prompts": (24, 12), "max_prompts": (240, 40),
    "rel_tol": (0.08, 0.15),
}
# --quick profiles fewer points than `pdserve profile --quick` (plan/profile.py: QUICK),
# still covering the quick workload's prompts, contexts and batches.
LIGHT_PROFILE: dict[str, Any] = {
    "prompts": [32, 128, 256, 512], "batch_prompts": (4, 128), "decode_batches": [1, 4, 16],
    "contexts": [64, 384], "decode_tokens": 8, "decode_passes": 2, "reps": 2,
    "transfer_sizes": [64, 512],
    "transfer_reps": 2, "contention_levels": 2, "contention_s": 1.0}
PICK_TOL = 0.10  # the planner's pick is right when within 10 % of the measured best
ERROR_GOAL_PCT = 20.0  # |planner - measured| / measured


@dataclass(frozen=True)
class GoodputConfig:
    quick: bool = opt(False, "a small study (256-token prompts, 32 output tokens, 6 s of "
                             "arrivals per rate, a lighter profile): a few minutes")
    out: str = opt("", "write results as JSON to this path (`summary`, `rows`); the profiles "
                       "and every run's `pdserve bench` line are kept next to it")
    plot: str = opt("", "folder for PNGs: SLO attainment vs rate and a TTFT-vs-TPOT scatter "
                        "per configuration", metavar="DIR")
    model: str = opt("", "model of every node (default: smollm2-135m)")
    cores: int = opt(0, "cores split between the nodes (0: the cores this process may use)")
    max_nodes: int = opt(4, "largest xPyD split of the default configurations (x + y <= "
                            "min(cores, this))")
    shapes: tuple[str, ...] = opt((), "configurations, comma-separated, e.g. 1C,1P1D,1P2D "
                                      "(default: 1C and every xPyD split of --cores up to "
                                      "--max-nodes)", type=comma_list(str))
    isl: int = opt(0, "prompt tokens of every request (0: 1024; --quick: 256)")
    osl: int = opt(0, "output tokens of every request (0: 128; --quick: 32)")
    slos: tuple[str, ...] = opt((), "SLO pairs NAME:TTFT_MS:TPOT_MS, comma-separated (default: "
                                    "loose, tight-ttft and tight-tpot chosen for the model "
                                    "and workload: SLO_DEFAULTS)",
                                type=comma_list(str))
    target: float = opt(0.9, "fraction of requests that must meet both objectives")
    probe_s: float = opt(0.0, "seconds of arrivals per measured rate (0: 30; --quick: 6)")
    min_prompts: int = opt(0, "fewest requests per rate (0: 24; --quick: 12)")
    max_prompts: int = opt(0, "most requests per rate (0: 240; --quick: 40)")
    rel_tol: float = opt(0.0, "measured bisection stops at this fraction of its bracket's "
                              "upper end (0: 0.08; --quick: 0.15)")
    transfer_backend: str = opt("tcp", "KV transfer backend of the PD stacks and profiles",
                                choices=("tcp", "mooncake"))
    profile_dir: str = opt("", "reuse profiles found here and keep new ones (MODEL-tT-BACKEND"
                               ".json); default: profile afresh")
    seed: int = opt(7, "seeds the arrivals (the same at every rate, scaled) and the prompts")

    def __post_init__(self) -> None:
        if self.cores < 0 or self.max_nodes < 2:
            raise ConfigError("--cores must be >= 0 and --max-nodes >= 2")
        if self.isl < 0 or self.osl < 0 or self.osl == 1:
            raise ConfigError("--isl must be >= 0 and --osl >= 2 (TPOT needs two tokens)")
        if not 0 < self.target <= 1:
            raise ConfigError(f"--target must be in (0, 1] (got {self.target})")
        if self.probe_s < 0 or self.min_prompts < 0 or self.max_prompts < 0:
            raise ConfigError("--probe-s, --min-prompts and --max-prompts must be >= 0")
        if self.max_prompts and self.min_prompts > self.max_prompts:
            raise ConfigError("--min-prompts must be <= --max-prompts")
        if not 0 <= self.rel_tol < 1:
            raise ConfigError("--rel-tol must be in [0, 1)")
        if self.transfer_backend not in ("tcp", "mooncake"):
            raise ConfigError("--transfer-backend must be tcp or mooncake")
        if self.slos:
            self.slo_list()
        if self.shapes:
            self.shape_list()

    def resolved(self) -> GoodputConfig:
        """Every 0 / "" mode default filled in (full run or --quick)."""
        pick = 1 if self.quick else 0
        values = {k: v[pick] for k, v in MODE_DEFAULTS.items() if not getattr(self, k)}
        cfg = replace(self, **values, cores=self.cores or usable_cores())
        if not cfg.slos:
            key = (cfg.model, cfg.isl, cfg.osl)
            if key not in SLO_DEFAULTS:
                raise ConfigError(f"--slos: no default SLO pairs for {cfg.model} with "
                                  f"{cfg.isl}/{cfg.osl} tokens; give NAME:TTFT_MS:TPOT_MS "
                                  "pairs")
            cfg = replace(cfg, slos=SLO_DEFAULTS[key])
        return cfg

    def slo_list(self) -> list[Slo]:
        out = []
        for item in self.slos:
            parts = item.split(":")
            try:
                slo = Slo(parts[0], float(parts[1]), float(parts[2]))
            except (IndexError, ValueError):
                raise ConfigError(f"--slos {item!r}: expected NAME:TTFT_MS:TPOT_MS") from None
            if len(parts) != 3 or not parts[0] or not (
                    0 < slo.ttft_ms < math.inf and 0 < slo.tpot_ms < math.inf):
                raise ConfigError(f"--slos {item!r}: expected NAME:TTFT_MS:TPOT_MS with "
                                  "both limits > 0")
            out.append(slo)
        if len({s.name for s in out}) != len(out):
            raise ConfigError("--slos: every pair needs its own name")
        return out

    def shape_list(self) -> list[Shape]:
        cores = self.cores or usable_cores()
        if not self.shapes:
            return default_shapes(cores, self.max_nodes)
        out = [parse_shape(s, cores) for s in self.shapes]
        if len({s.label for s in out}) != len(out):
            raise ConfigError("--shapes: a configuration is listed twice")
        return out

    def prompts_at(self, rate: float) -> int:
        """Requests of the run at `rate` (same count for the simulator and the bench)."""
        return max(self.min_prompts, min(self.max_prompts, round(rate * self.probe_s)))


@dataclass(frozen=True)
class Slo:
    name: str
    ttft_ms: float
    tpot_ms: float

    def as_bench(self) -> dict[str, float]:
        """`pdserve bench --goodput` keys (`metrics.meets_slos`)."""
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms}

    def as_plan(self) -> dict[str, float]:
        """`pdserve plan` SLO keys in seconds; the percentile suffix is not used by the
        per-request attainment (`search.evaluate`)."""
        return {"ttft_p90": self.ttft_ms / 1e3, "tpot_p90": self.tpot_ms / 1e3}


@dataclass(frozen=True)
class Shape:
    prefill: int  # 0: one colocated node
    decode: int
    threads: int  # forward threads of every node

    @property
    def pd(self) -> bool:
        return self.prefill > 0

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode if self.pd else 1

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.pd else "1C"


def default_shapes(cores: int, max_nodes: int) -> list[Shape]:
    """One colocated node on every core, then each xPyD whose nodes fit the cores (at least
    one thread each), the threads split evenly as `pdserve up` does (`cpus.split_cores`)."""
    out = [Shape(0, 0, cores)]
    for n in range(2, min(cores, max_nodes) + 1):
        out += [Shape(x, n - x, cores // n) for x in range(1, n)]
    return out


def parse_shape(text: str, cores: int) -> Shape:
    """"1C" or "xPyD" (threads: the cores split between the nodes)."""
    t = text.strip().upper()
    if t == "1C":
        return Shape(0, 0, cores)
    p, sep, d = t.removesuffix("D").partition("P")
    if not (sep and t.endswith("D") and p.isdigit() and d.isdigit() and int(p) and int(d)):
        raise ConfigError(f"--shapes {text!r}: expected 1C or xPyD, e.g. 1P1D")
    x, y = int(p), int(d)
    if x + y > cores:
        raise ConfigError(f"--shapes {text!r}: {x + y} nodes need at least {x + y} cores "
                          f"(have {cores})")
    return Shape(x, y, cores // (x + y))


# ---- the search --------------------------------------------------------------------------

def bisect_rate(attainment_at: Callable[[float], float], lo: float, hi: float,
                target: float = 0.9, tol: float = 0.05) -> float:
    """The highest rate in [lo, hi] found to reach `target` attainment, assuming attainment
    falls with rate: within `tol` below the crossing. `hi` when even `hi` reaches it (the
    goodput is at least that); 0.0 when not even `lo` does (it is below `lo`).

    The ends are measured only when the bisection closes on them (a rate costs a real load
    test): a search whose crossing lies inside the bracket never runs `lo` or `hi`. With
    noisy attainment the answer is a rate where the measured attainment crosses the target.
    """
    if not 0 < lo < hi or not tol > 0:
        raise ValueError(f"need 0 < lo < hi and tol > 0 (got lo={lo}, hi={hi}, tol={tol})")
    good, bad = lo, hi  # good: assumed to pass, bad: assumed to fail (checked lazily)
    while bad - good > tol:
        mid = (good + bad) / 2
        if attainment_at(mid) >= target:
            good = mid
        else:
            bad = mid
    if good == lo and attainment_at(lo) < target:
        return 0.0
    if bad == hi and attainment_at(hi) >= target:
        return hi
    return good


def attainment_of(results: Sequence[Any], slo: Slo) -> float:
    """Fraction of all requests of a run (failures count as misses) meeting both SLOs."""
    from pdserve.loadtest.metrics import meets_slos

    if not results:
        return 0.0
    return sum(meets_slos(r, slo.as_bench()) for r in results) / len(results)


@dataclass
class Probe:
    """One measured run at one rate."""

    rate: float
    results: list  # loadtest.metrics.RequestResult
    row: dict  # its `pdserve bench` JSONL record

    def brief(self, slos: Sequence[Slo]) -> dict:
        r = self.row
        return {"rate": round(self.rate, 4), "requests": len(self.results),
                "failed": r["failed"], "duration_s": round(r["duration"], 2),
                "ttft_p50_ms": round(r["median_ttft_ms"], 1),
                "ttft_p90_ms": round(r["p90_ttft_ms"], 1),
                "tpot_p50_ms": round(r["median_tpot_ms"], 2),
                "tpot_p90_ms": round(r["p90_tpot_ms"], 2),
                "attainment": {s.name: round(attainment_of(self.results, s), 3) for s in slos}}


class Planner:
    """`pdserve plan`'s simulator for one configuration: attainment at a rate on the
    requests the bench sends at that rate."""

    def __init__(self, prof: Any, shape: Shape, cfg: GoodputConfig, background: float,
                 machine_cores: int) -> None:
        from pdserve.plan.search import node_spec
        from pdserve.plan.sim import ClusterSpec

        self.prof, self.cfg = prof, cfg
        self.cluster = ClusterSpec(prefill=shape.prefill, decode=shape.decode,
                                   colocated=0 if shape.pd else 1, node=node_spec(prof),
                                   machine_cores=machine_cores, node_threads=shape.threads,
                                   background_load=background)
        self._memo: dict[tuple[float, str], float] = {}

    def prefill_bound(self) -> float:
        """Requests/s the prefill nodes could take if they did nothing else: no goodput
        exceeds it by much (a finite run may pass a little above it)."""
        isl = self.cfg.isl
        nodes = self.cluster.prefill or self.cluster.colocated
        return nodes / self.prof.extend_s(isl, isl * isl)

    def attainment(self, rate: float, slo: Slo) -> float:
        key = (round(rate, 9), slo.name)
        if key not in self._memo:
            import numpy as np

            from pdserve.loadtest.arrivals import arrival_times
            from pdserve.plan.search import evaluate
            from pdserve.plan.sim_fast import simulator_for
            from pdserve.plan.workload import Workload

            n, cfg = self.cfg.prompts_at(rate), self.cfg
            wl = Workload(arrival_times(n, rate, 1.0, cfg.seed), np.full(n, cfg.isl),
                          np.full(n, cfg.osl))
            res = simulator_for(self.prof, self.cluster, wl, cfg.seed).run(wl)
            self._memo[key] = evaluate(res, wl, self.cluster, 1.0, slo.as_plan()).attainment
        return self._memo[key]


class LiveStack:
    """A started configuration and its measured runs, one per rate, shared by the SLO
    pairs. Runs go through `pdserve.loadtest.runner` in this process."""

    def __init__(self, shape: Shape, cfg: GoodputConfig, work: Path,
                 jsonl: Path | None) -> None:
        self.shape, self.cfg, self.work, self.jsonl = shape, cfg, work, jsonl
        self.probes: dict[float, Probe] = {}
        self.proc: Any = None
        self.url = ""
        self._setup: Any = None

    def command(self) -> list[str]:
        base = [sys.executable, "-m", "pdserve.cli"]
        s, cfg = self.shape, self.cfg
        if not s.pd:
            return [*base, "serve", "--model", cfg.model, "--threads", str(s.threads)]
        return [*base, "up", "--model", cfg.model, "--prefill", str(s.prefill), "--decode",
                str(s.decode), "--node-threads", str(s.threads), "--transfer-backend",
                cfg.transfer_backend, "--log-dir", str(self.work / f"logs-{s.label}")]

    def __enter__(self) -> LiveStack:
        from pd_vs_colocated import start

        self.proc, self.url = start(self.command(), self.work / f"{self.shape.label}.log")
        try:
            self._setup = asyncio.run(self._prepare())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        from pd_vs_colocated import stop

        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def bench_config(self, rate: float, n: int) -> Any:
        from pdserve.loadtest.config import BenchConfig

        cfg = self.cfg
        return BenchConfig(base_url=self.url, backend="generate", num_prompts=n,
                           random_input_len=cfg.isl, random_output_len=cfg.osl,
                           random_range_ratio=0.0, request_rate=rate, seed=cfg.seed,
                           warmup_requests=2, ignore_eos=True, disable_tqdm=True,
                           percentiles=(50.0, 90.0, 99.0), label=self.shape.label)

    async def _prepare(self) -> Any:
        from pdserve.loadtest import runner

        bc = self.bench_config(1.0, 2)
        async with runner.new_client(bc) as client:
            setup = await runner.prepare(bc, client)
            await runner.warmup(bc, setup, client)  # compile, caches, connections
        return setup

    def attainment(self, rate: float, slo: Slo) -> float:
        return attainment_of(self.probe(rate).results, slo)

    def probe(self, rate: float) -> Probe:
        key = round(rate, 9)
        if key not in self.probes:
            self.probes[key] = asyncio.run(self._run(rate))
            p = self.probes[key]
            print(f"  {self.shape.label} @ {rate:.3g} req/s: {len(p.results)} requests, "
                  f"{p.row['failed']} failed, TTFT p90 {p.row['p90_ttft_ms']:.0f} ms, TPOT p90 "
                  f"{p.row['p90_tpot_ms']:.1f} ms", flush=True)
        return self.probes[key]

    async def _run(self, rate: float) -> Probe:
        from pdserve.loadtest import report, runner
        from pdserve.loadtest.dataset import build_prompts

        bc = self.bench_config(rate, self.cfg.prompts_at(rate))
        # Fresh prompt tokens per run (the arrivals keep --seed): a prompt sent at an
        # earlier rate would be a prefix-cache hit and a falsely short TTFT.
        prompt_seed = self.cfg.seed * 100_003 + 1 + len(self.probes)
        prompts = build_prompts(replace(bc, seed=prompt_seed), self._setup.tokenizer)
        setup = replace(self._setup, prompts=prompts)
        async with runner.new_client(bc) as client:
            outcome = await runner.run_once(bc, setup, client)
        row = report.result_row(outcome)
        if self.jsonl is not None:
            report.append_jsonl(self.jsonl, row)
        return Probe(rate, outcome.results, row)


def search_goodput(attain: Callable[[float], float], guess: float, floor: float,
                   ceiling: float, target: float, rel_tol: float,
                   known: Sequence[tuple[float, float]] = ()) -> tuple[float, str]:
    """Goodput in [floor, ceiling] without trusting `guess`: bracket it first — the highest
    passing rate and the lowest failing one above it, from the `known` (rate, attainment)
    runs (another SLO pair's, free) and new runs at `guess` halved or doubled until both
    exist — then `bisect_rate` inside to `rel_tol` of the bracket's top (its ends are known
    runs: not run again). (goodput, edge): edge "above" when even `ceiling` passes (the
    goodput is at least that), "below" when not even `floor` does (returned as 0.0)."""
    seen = dict(known)

    def run(rate: float) -> float:
        seen[rate] = attain(rate)
        return seen[rate]

    def bracket() -> tuple[float | None, float | None]:
        passes = [r for r, a in seen.items() if a >= target]
        lo = max(passes, default=None)
        # failures below a pass are noise: the crossing lies above the highest pass
        return lo, min((r for r, a in seen.items() if a < target and (lo is None or r > lo)),
                       default=None)

    lo, hi = bracket()
    if lo is None and hi is None:
        run(min(max(guess, floor), ceiling))
        lo, hi = bracket()
    while lo is None:  # every run so far failed: halve below the lowest failure
        assert hi is not None
        if hi <= floor or (hi / 2 < floor and run(floor) < target):
            return 0.0, "below"
        if hi / 2 >= floor:
            run(hi / 2)
        lo, hi = bracket()
    while hi is None:  # every run so far passed: double above the highest pass
        assert lo is not None
        if lo >= ceiling or (lo * 2 > ceiling and run(ceiling) >= target):
            return max(lo, ceiling), "above"
        if lo * 2 <= ceiling:
            run(lo * 2)
        lo, hi = bracket()
    assert lo is not None
    return bisect_rate(attain, lo, hi, target, rel_tol * hi), ""


def snap(rate: float, anchor: float) -> float:
    """`rate` moved to the nearest anchor x 2^k: the SLO pairs' searches start on one grid
    of rates, so their halvings and doublings land on runs already made."""
    if rate <= 0 or anchor <= 0:
        return anchor
    return anchor * 2.0 ** round(math.log2(rate / anchor))


# ---- the result --------------------------------------------------------------------------

@dataclass(frozen=True)
class Figure:
    """Goodput of one configuration at one SLO pair, measured and planned (req/s)."""

    config: str
    threads: int
    slo: str
    measured: float
    planner: float
    measured_edge: str = ""  # "above": at least `measured`; "below": under the bracket
    planner_edge: str = ""
    runs: int = 0  # measured runs the configuration needed (all SLO pairs)


def error_pct(f: Figure) -> float | None:
    """(planner - measured) / measured in %; None when the measured goodput is 0 or only a
    bound."""
    if f.measured <= 0 or f.measured_edge:
        return None
    return 100.0 * (f.planner - f.measured) / f.measured


def _best(figs: list[Figure], key: Callable[[Figure], float]) -> Figure:
    # ties go to the earlier configuration (colocated first: the simpler one)
    return max(figs, key=key)


def build_summary(figures: Sequence[Figure], slos: Sequence[Slo], pick_tol: float = PICK_TOL,
                  error_goal_pct: float = ERROR_GOAL_PCT
                  ) -> tuple[list[dict], list[dict], dict]:
    """(rows: one per configuration and SLO pair, picks: one per SLO pair, summary)."""
    rows = []
    for f in figures:
        err = error_pct(f)
        rows.append({"config": f.config, "threads": f.threads, "slo": f.slo,
                     "measured_req_s": round(f.measured, 3),
                     "measured_bound": {"above": ">=", "below": "<lo"}.get(f.measured_edge, ""),
                     "planner_req_s": round(f.planner, 3),
                     "planner_bound": {"above": ">=", "below": "<lo"}.get(f.planner_edge, ""),
                     "error_pct": None if err is None else round(err, 1), "runs": f.runs})
    picks: list[dict] = []
    goodput: dict[str, dict[str, dict]] = {}
    within: dict[str, bool] = {}
    verdicts: dict[str, str] = {}
    for slo in slos:
        figs = [f for f in figures if f.slo == slo.name]
        if not figs:
            continue
        pick = _best(figs, lambda f: f.planner)
        best = _best(figs, lambda f: f.measured)
        ok = pick.measured >= (1 - pick_tol) * best.measured
        within[slo.name] = ok
        verdicts[slo.name] = pd_verdict(figs)
        picks.append({"slo": slo.name, "ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms,
                      "planner_pick": pick.config, "measured_best": best.config,
                      "pick_measured_req_s": round(pick.measured, 3),
                      "best_measured_req_s": round(best.measured, 3),
                      "pick_within_10pct": ok})
        for f in figs:
            err = error_pct(f)
            goodput.setdefault(f.config, {})[slo.name] = {
                "measured": round(f.measured, 3), "planner": round(f.planner, 3),
                "measured_edge": f.measured_edge, "planner_edge": f.planner_edge,
                "error_pct": None if err is None else round(err, 1)}
    errs = [abs(e) for f in figures if (e := error_pct(f)) is not None]
    summary = {
        "goodput_req_s": goodput,
        "planner_pick": {p["slo"]: p["planner_pick"] for p in picks},
        "measured_best": {p["slo"]: p["measured_best"] for p in picks},
        "pick_within_10pct": within,
        "goal_pick_within_10pct_every_slo": bool(within) and all(within.values()),
        "max_abs_error_pct": round(max(errs), 1) if errs else None,
        "median_abs_error_pct": round(statistics.median(errs), 1) if errs else None,
        "goal_error_pct": error_goal_pct,
        "goal_error_met": bool(errs) and max(errs) <= error_goal_pct,
        "errors_compared": len(errs),
        "pd_vs_colocated": verdicts,
    }
    return rows, picks, summary


def pd_verdict(figs: Sequence[Figure]) -> str:
    """Where PD wins or loses at one SLO pair, measured, in one sentence."""
    colo = next((f for f in figs if f.config == "1C"), None)
    pds = [f for f in figs if f.config != "1C"]
    if colo is None or not pds:
        return "no colocated-vs-PD comparison (one kind only)"
    pd = _best(pds, lambda f: f.measured)
    a, b = colo.measured, pd.measured
    head = (f"colocated ({colo.threads} threads) {a:.3g} vs {pd.config} ({pd.threads} "
            f"thread{'s' * (pd.threads > 1)} per node) {b:.3g} req/s")
    if max(a, b) <= 0:
        return f"{head}: neither meets this pair at any rate tried"
    if b > a * (1 + PICK_TOL):
        return (f"{head}: PD wins — the colocated node's prefill batches stall its decodes, "
                "and keeping them apart is worth more than the threads each node gives up")
    if a > b * (1 + PICK_TOL):
        return (f"{head}: PD loses — the split does not add cores, it divides them: each "
                "prefill and decode step runs on fewer threads, plus the router hop and "
                "the KV transfer")
    return f"{head}: a draw (within {PICK_TOL:.0%})"


# ---- plots -------------------------------------------------------------------------------

def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_attainment(path: Path, label: str, slos: Sequence[Slo], target: float,
                    measured: dict[str, list[tuple[float, float]]],
                    planned: dict[str, list[tuple[float, float]]],
                    goodput: dict[str, tuple[float, float]]) -> Path:
    """Measured points and the planner's curve of attainment vs rate, one colour per SLO
    pair, each goodput marked (solid: measured, dotted: planner)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, slo in enumerate(slos):
        color = f"C{i % 10}"
        pts = sorted(planned.get(slo.name, []))
        if pts:
            ax.plot([r for r, _ in pts], [100 * a for _, a in pts], "-", color=color,
                    alpha=0.6, label=f"{slo.name} planner")
        pts = sorted(measured.get(slo.name, []))
        if pts:
            ax.plot([r for r, _ in pts], [100 * a for _, a in pts], "o", color=color,
                    label=f"{slo.name} measured")
        meas, plan = goodput.get(slo.name, (0.0, 0.0))
        if meas > 0:
            ax.axvline(meas, color=color, linewidth=1)
        if plan > 0:
            ax.axvline(plan, color=color, linewidth=1, linestyle=":")
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests meeting TTFT and TPOT (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{label}: SLO attainment vs rate (lines: goodput)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def plot_scatter(path: Path, label: str, slos: Sequence[Slo],
                 points: Sequence[tuple[float, float, float]]) -> Path:
    """Every measured request's (TPOT, TTFT) in ms coloured by its run's rate, with each
    SLO pair's box (a request inside a box meets that pair)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    if points:
        sc = ax.scatter([p[1] for p in points], [p[0] for p in points],
                        c=[p[2] for p in points], s=8, cmap="viridis", alpha=0.7)
        fig.colorbar(sc, ax=ax, label="request rate (req/s)")
    for i, slo in enumerate(slos):
        ax.plot([0, slo.tpot_ms, slo.tpot_ms], [slo.ttft_ms, slo.ttft_ms, 0], "--",
                color=f"C{i % 10}", label=f"{slo.name} ({slo.ttft_ms:g} / "
                                                  f"{slo.tpot_ms:g} ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("TPOT (ms)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"{label}: TTFT vs TPOT per request, every measured rate", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the study ---------------------------------------------------------------------------

def get_profile(cfg: GoodputConfig, threads: int, pd: bool, keep: Path | None) -> Any:
    """`pdserve profile` of the model at `threads` forward threads (the PD serving overheads
    only when a PD configuration runs at that count), reused from --profile-dir."""
    from kv_transfer.config import Backend
    from pdserve.config import EngineConfig
    from pdserve.plan.profile import run_profile
    from pdserve.plan.profile_model import Profile

    name = f"{cfg.model}-t{threads}-{cfg.transfer_backend}{'-light' * cfg.quick}.json"
    cached = Path(cfg.profile_dir) / name if cfg.profile_dir else None
    if cached is not None and cached.exists():
        prof = Profile.load(cached)
        if (prof.model == cfg.model and prof.torch_threads == threads
                and (not pd or prof.pd_request_overhead_s is not None)):
            print(f"profile: reusing {cached}")
            return prof
    backend: Backend = "mooncake" if cfg.transfer_backend == "mooncake" else "tcp"
    prof = run_profile(EngineConfig(model=cfg.model, threads=threads), quick=True,
                       backend=backend, plan=LIGHT_PROFILE if cfg.quick else None,
                       serving_pd=pd)
    for path in (cached, keep):
        if path is not None:
            prof.save(path)
    return prof


def _flip(attainment: Callable[[float, Slo], float], slo: Slo, rate: float) -> float:
    return attainment(rate, slo)


def study_shape(shape: Shape, prof: Any, cfg: GoodputConfig, slos: list[Slo], work: Path,
                jsonl: Path | None) -> tuple[list[Figure], dict]:
    """Planner then measured goodput of one configuration at every SLO pair."""
    from pdserve.plan.profile_contention import runnable_now

    # other processes' runnable threads just before this stack starts (plan_accuracy.py)
    background = runnable_now(2.0)
    planner = Planner(prof, shape, cfg, background, usable_cores())
    bound = planner.prefill_bound()
    # the simulator is cheap: a fine search over a wide range
    planned = {s.name: search_goodput(partial(_flip, planner.attainment, s), bound / 4,
                                      bound / 1000, 4 * bound, cfg.target, 0.005)
               for s in slos}
    print(f"{shape.label} ({shape.threads} threads/node): background load {background:.2f}; "
          "planner goodput " + ", ".join(f"{k} {g:.3g}" for k, (g, _) in planned.items()),
          flush=True)
    # Real runs start from the planner's figures (snapped to one grid) and bracket from
    # there, so a planner far off costs a few halvings, not a wrong answer. The floor: a
    # run of --min-prompts requests lasting at most 6 x --probe-s.
    floor = cfg.min_prompts / (6 * cfg.probe_s)
    anchor = min(max(max(g for g, _ in planned.values()), floor), 4 * bound)
    # a pair the planner says no rate meets starts at the floor: one run if it is right
    guesses = {k: snap(g, anchor) if g > 0 else floor for k, (g, _) in planned.items()}
    t0 = time.monotonic()
    measured: dict[str, tuple[float, str]] = {}
    with LiveStack(shape, cfg, work, jsonl) as stack:
        for s in slos:
            known = [(p.rate, attainment_of(p.results, s)) for p in stack.probes.values()]
            measured[s.name] = search_goodput(partial(_flip, stack.attainment, s),
                                              guesses[s.name], floor, 4 * bound, cfg.target,
                                              cfg.rel_tol, known=known)
    probes = sorted(stack.probes.values(), key=lambda p: p.rate)
    figs = [Figure(shape.label, shape.threads, s.name, measured[s.name][0],
                   planned[s.name][0], measured[s.name][1], planned[s.name][1], len(probes))
            for s in slos]
    top = max([p.rate for p in probes] + [g for g, _ in planned.values()] + [floor])
    rates = sorted({p.rate for p in probes} | {1.25 * top * k / 16 for k in range(1, 17)})
    detail = {
        "threads": shape.threads, "background_load": round(background, 2),
        "prefill_bound_req_s": round(bound, 3),
        "floor_req_s": round(floor, 4),
        "first_rate_req_s": {k: round(g, 4) for k, g in guesses.items()},
        "measure_wall_s": round(time.monotonic() - t0, 1),
        "runs": [p.brief(slos) for p in probes],
        "_measured": {s.name: [(p.rate, attainment_of(p.results, s)) for p in probes]
                      for s in slos},
        "_planned": {s.name: [(r, planner.attainment(r, s)) for r in rates] for s in slos},
        "_points": [(r.ttft * 1e3, r.tpot * 1e3, p.rate) for p in probes for r in p.results
                    if r.success and r.tpot is not None],
    }
    return figs, detail


def parse_args(argv: list[str] | None = None) -> GoodputConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dataclass_flags(parser, GoodputConfig, "goodput")
    args = parser.parse_args(argv)
    try:
        return GoodputConfig(**values_from(GoodputConfig, args)).resolved()
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; this keeps mypy's flow analysis honest


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    shapes, slos = cfg.shape_list(), cfg.slo_list()
    print(f"goodput study: {cfg.model}, {cfg.isl}-token prompts, {cfg.osl} output tokens, "
          f"Poisson; {cfg.cores} cores: {', '.join(s.label for s in shapes)}; SLO pairs (TTFT/"
          f"TPOT ms): {', '.join(f'{s.name} {s.ttft_ms:g}/{s.tpot_ms:g}' for s in slos)}",
          flush=True)
    t0, load_before = time.monotonic(), os.getloadavg()
    out = Path(cfg.out) if cfg.out else None
    jsonl = out.with_suffix(".runs.jsonl") if out else None
    if jsonl is not None:
        jsonl.unlink(missing_ok=True)
    figures: list[Figure] = []
    details: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        profiles = {}
        for t in sorted({s.threads for s in shapes}, reverse=True):
            pd = any(s.pd and s.threads == t for s in shapes)
            keep = out.with_suffix(f".profile-t{t}.json") if out else None
            profiles[t] = get_profile(cfg, t, pd, keep)
        for shape in shapes:
            figs, details[shape.label] = study_shape(shape, profiles[shape.threads], cfg,
                                                     slos, Path(tmp), jsonl)
            figures += figs
    rows, picks, summary = build_summary(figures, slos)
    print()
    print_table(rows, ["config", "threads", "slo", "measured_bound", "measured_req_s",
                       "planner_bound", "planner_req_s", "error_pct", "runs"])
    print()
    print_table(picks, ["slo", "ttft_ms", "tpot_ms", "planner_pick", "measured_best",
                        "pick_measured_req_s", "best_measured_req_s", "pick_within_10pct"])
    print()
    for name, text in summary["pd_vs_colocated"].items():
        print(f"{name}: {text}")
    busy = max(d["background_load"] for d in details.values())
    if busy >= 1:  # a node on all the cores loses many times its speed to one more thread
        print(f"warning: other processes held up to {busy:.1f} runnable threads before a "
              "stack started: every measured figure is slowed by them (run on a quiet "
              "machine)")
    print(f"goals: planner's pick within 10 % of the measured best at every SLO pair: "
          f"{summary['goal_pick_within_10pct_every_slo']}; planner goodput error <= "
          f"{ERROR_GOAL_PCT:g} %: {summary['goal_error_met']} (max "
          f"{summary['max_abs_error_pct']} % over {summary['errors_compared']} figures)")
    if cfg.plot:
        for shape in shapes:
            d = details[shape.label]
            gp = {f.slo: (f.measured, f.planner) for f in figures if f.config == shape.label}
            plot_attainment(Path(cfg.plot) / f"{shape.label}_attainment.png", shape.label,
                            slos, cfg.target, d["_measured"], d["_planned"], gp)
            plot_scatter(Path(cfg.plot) / f"{shape.label}_ttft_tpot.png", shape.label, slos,
                         d["_points"])
        print(f"plots: {cfg.plot}/*_attainment.png, *_ttft_tpot.png")
    summary.update({
        "model": cfg.model, "cores": cfg.cores, "machine_cores": usable_cores(),
        "workload": {"isl": cfg.isl, "osl": cfg.osl, "arrivals": "poisson",
                     "probe_s": cfg.probe_s, "prompts_per_rate": [cfg.min_prompts,
                                                                  cfg.max_prompts]},
        "slo_ms": {s.name: {"ttft": s.ttft_ms, "tpot": s.tpot_ms} for s in slos},
        "target_attainment": cfg.target,
        "configs": {k: {x: y for x, y in d.items() if not x.startswith("_")}
                    for k, d in details.items()},
        # other work on the machine moves every measured figure (docs/benchmarks.md)
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "wall_s": round(time.monotonic() - t0, 1),
    })
    print("summary:", json.dumps({k: summary[k] for k in (
        "goodput_req_s", "planner_pick", "measured_best", "pick_within_10pct",
        "max_abs_error_pct", "wall_s")}))
    summary["picks"] = picks
    write_json(cfg.out, summary, rows, argparse.Namespace(**asdict(cfg)))


if __name__ == "__main__":
    main()
