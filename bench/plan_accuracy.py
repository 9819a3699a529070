"""`pdserve plan`'s predictions against real stacks on this machine, plus simulator speed.

1. `pdserve profile` of the model (real engine, KV transfer between two processes, serving
   overheads through a real node);
2. for each shape (1P1D, 1P2D, 2P1D, colocated) and rate: the simulator's p50/p90 TTFT and
   TPOT, then the same seeded `pdserve bench` run (same arrival times, fixed lengths)
   against `pdserve up` (or `pdserve serve` for colocated), and the relative error;
3. simulator scale (`bench/plan_scale.py`, which also runs the whole hour): 500 nodes
   (250P250D) at 10,000 req/s for `--scale-seconds` simulated seconds with the fast
   simulator, and the projected wall time of one simulated hour.
Every node (profiled, and in every stack) runs `--node-threads` forward threads (default:
the cores split between two nodes, what `pdserve up` gives a 1P1D stack), so the profile
is of the nodes that serve. Every process of a stack shares this machine's cores: the
simulation models that with `machine_cores = os.cpu_count()` and the profile's measured
contention curve (a step that starts while other nodes compute, or while other processes
run, is as much slower as the profile measured with that many extra runnable threads
beyond the background it was profiled under). Other processes on the machine are
`background_load` = the mean count of runnable threads (`/proc/loadavg` field 4, less this
sampler) over 2 s just before each stack starts (`pred_loaded`); `pred_quiet` assumes
none. Both are reported, with that count. Simulator speed is timed on a fixed GPU-like
reference profile, so it does not depend on how loaded this machine was.

    python bench/plan_accuracy.py [--quick] [--out bench/out/plan_accuracy.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402
from pd_vs_colocated import start, stop  # noqa: E402
from plan_scale import measure as scale_measure  # noqa: E402

from pdserve.cli import main as pdserve_main  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402
from pdserve.cpus import split_cores  # noqa: E402
from pdserve.loadtest.arrivals import arrival_times  # noqa: E402
from pdserve.loadtest.report import row_stat  # noqa: E402
from pdserve.plan.profile import run_profile  # noqa: E402
from pdserve.plan.profile_contention import runnable_now  # noqa: E402
from pdserve.plan.search import node_spec  # noqa: E402
from pdserve.plan.sim import ClusterSpec, Simulator  # noqa: E402
from pdserve.plan.workload import Workload  # noqa: E402

METRICS = (("ttft", 50), ("ttft", 90), ("tpot", 50), ("tpot", 90))


def shape_of(text: str) -> tuple[int, int, int]:
    if text.endswith("C"):
        return 0, 0, int(text[:-1])
    p, d = text.rstrip("D").split("P")
    return int(p), int(d), 0


def predict(prof, shape: str, rate: float, args, background: float) -> dict:
    import numpy as np

    p, d, c = shape_of(shape)
    cluster = ClusterSpec(prefill=p, decode=d, colocated=c, node=node_spec(prof),
                          machine_cores=os.cpu_count() or 1, node_threads=prof.torch_threads,
                          background_load=background)
    n = args.num_prompts
    wl = Workload(arrival_times(n, rate, 1.0, args.seed), np.full(n, args.isl),
                  np.full(n, args.osl))
    res = Simulator(prof, cluster, args.seed).run(wl)
    vals = {"ttft": res.ttft, "tpot": res.tpot}
    return {f"{m}_p{q}": 1e3 * float(np.nanpercentile(vals[m], q)) for m, q in METRICS}


def measure(shape: str, rate: float, args, work: Path) -> dict:
    """Run the shape for real; `rows["load"]` is the 1-minute load average and
    `rows["runnable"]` the runnable threads of other processes just before the stack
    started (for the background-load model)."""
    p, d, c = shape_of(shape)
    common = ["--model", args.model]
    if c:  # every node runs the profile's forward threads
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", *common, "--threads",
               str(args.node_threads)]
    else:
        cmd = [sys.executable, "-m", "pdserve.cli", "up", *common, "--prefill", str(p),
               "--decode", str(d), "--transfer-backend", args.transfer_backend,
               "--node-threads", str(args.node_threads),
               "--log-dir", str(work / f"logs-{shape}")]
    load = os.getloadavg()[0]
    runnable = runnable_now(2.0)
    proc, url = start(cmd, work / f"{shape}.log")
    out = work / f"{shape}.jsonl"
    rows: dict = {"load": load, "runnable": runnable}
    try:
        for r in args.rate_list:
            if r != rate and rate is not None:
                continue
            pdserve_main(["bench", "--base-url", url, "--backend", "generate",
                          "--num-prompts", str(args.num_prompts), "--request-rate", str(r),
                          "--random-input-len", str(args.isl), "--random-output-len",
                          str(args.osl), "--random-range-ratio", "0", "--ignore-eos",
                          "--seed", str(args.seed), "--percentiles", "50,90",
                          "--output-file", str(out), "--disable-tqdm", "--label", shape])
            row = json.loads(out.read_text().splitlines()[-1])
            rows[r] = {f"{m}_p{q}": row_stat(row, m, q) for m, q in METRICS}
            rows[r]["failed"] = row["failed"]
    finally:
        stop(proc)
    return rows


def rel(pred: float, meas: float | None) -> float | None:
    return abs(pred - meas) / meas if meas else None


def signed(pred: float, meas: float | None) -> float | None:
    """(pred - meas) / meas: < 0 when the prediction is low (a missing cost shows here)."""
    return (pred - meas) / meas if meas else None


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--shapes", default="1P1D,1P2D,2P1D,1C")
    parser.add_argument("--rates", default="")
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=0)
    parser.add_argument("--transfer-backend", default="tcp", choices=["tcp", "mooncake"])
    parser.add_argument("--scale-seconds", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--node-threads", type=int, default=0,
                        help="forward threads of every node, profiled and served "
                             "(0: the cores split between two nodes, as `pdserve up` does)")
    args = parser.parse_args()
    args.node_threads = args.node_threads or split_cores(2)
    args.rate_list = [float(r) for r in (args.rates or ("2,6" if args.quick else "2,4,8"))
                      .split(",")]
    args.num_prompts = args.num_prompts or (30 if args.quick else 80)
    args.scale_seconds = args.scale_seconds or (60.0 if args.quick else 300.0)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="plan-acc-") as tmp:
        work = Path(tmp)
        prof = run_profile(EngineConfig(model=args.model, threads=args.node_threads), quick=True,
                           backend=args.transfer_backend)
        prof.save(work / "profile.json")
        if args.out:  # kept next to the results: `pdserve plan --profile` can reuse it
            prof.save(Path(args.out).with_suffix(".profile.json"))
        rows = []
        for shape in args.shapes.split(","):
            measured = measure(shape, None, args, work)
            for rate in args.rate_list:
                quiet = predict(prof, shape, rate, args, 0.0)
                loaded = predict(prof, shape, rate, args, measured["runnable"])
                meas = measured[rate]
                for m, q in METRICS:
                    key = f"{m}_p{q}"
                    rows.append({"shape": shape, "rate": rate, "metric": key,
                                 "pred_quiet_ms": quiet[key], "pred_loaded_ms": loaded[key],
                                 "measured_ms": meas[key], "rel_err_quiet": rel(quiet[key],
                                                                               meas[key]),
                                 "rel_err": rel(loaded[key], meas[key]),
                                 "signed_err": signed(loaded[key], meas[key]),
                                 "load": round(measured["load"], 2),
                                 "runnable": round(measured["runnable"], 2),
                                 "failed": meas["failed"]})
    print_table(rows, ["shape", "rate", "metric", "pred_quiet_ms", "pred_loaded_ms",
                       "measured_ms", "rel_err_quiet", "rel_err", "signed_err", "load",
                       "runnable", "failed"])
    errs = [r["rel_err"] for r in rows if r["rel_err"] is not None]
    errs_quiet = [r["rel_err_quiet"] for r in rows if r["rel_err_quiet"] is not None]
    by_metric = {k: round(statistics.median([r["rel_err"] for r in rows if r["metric"] == k
                                             and r["rel_err"] is not None]), 3)
                 for k in {r["metric"] for r in rows}}
    signed_by_metric = {k: round(statistics.median([
        r["signed_err"] for r in rows if r["metric"] == k and r["signed_err"] is not None]), 3)
        for k in {r["metric"] for r in rows}}
    sc, _ = scale_measure(args.scale_seconds, min(3.0, args.scale_seconds))
    print("scale:", sc)
    summary = {"median_rel_err": round(statistics.median(errs), 3),
               "median_rel_err_without_background_load": round(
                   statistics.median(errs_quiet), 3),
               "median_rel_err_by_metric": by_metric, "goal_median_rel_err": 0.25,
               "median_signed_err": round(statistics.median(
                   [r["signed_err"] for r in rows if r["signed_err"] is not None]), 3),
               "median_signed_err_by_metric": signed_by_metric,
               "profile": {"prefill_coef": prof.prefill_coef, "decode_coef": prof.decode_coef,
                           "contention": prof.contention,
                           "background_load": prof.background_load,
                           "request_overhead_s": prof.request_overhead_s,
                           "step_overhead_s": prof.step_overhead_s,
                           "pd_request_overhead_s": prof.pd_request_overhead_s,
                           "pd_step_overhead_s": prof.pd_step_overhead_s,
                           "transfer_gbps": prof.transfer_gbps},
               "scale": sc, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
               "profile_loadavg": prof.points["loadavg"],
               "wall_s": round(time.monotonic() - t0, 1), "model": args.model,
               "node_threads": args.node_threads}
    print("summary:", json.dumps(summary))
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
