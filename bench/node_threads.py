"""Forward threads of the nodes of a local stack: the cores split between them (`pdserve
up`'s default) against one thread per core in every node (the old default), side by side.

Each setting starts the same `pdserve up` stack (1P1D by default) and runs the same seeded
`pdserve bench` load (Poisson arrivals, fixed prompt and output lengths), alternating the
settings `--repeats` times so machine noise hits both alike. The ratios in `summary` are
split ÷ per-core (< 1 for latencies: the split is faster).
See docs/architecture.md: CPU threads.

    python bench/node_threads.py [--quick] [--out bench/out/node_threads.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402
from pd_vs_colocated import start, stop  # noqa: E402

from pdserve.cli import main as pdserve_main  # noqa: E402
from pdserve.cpus import split_cores, usable_cores  # noqa: E402

STATS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "output_throughput")


def run(label: str, threads: int, args, work: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", args.model,
           "--prefill", str(args.prefill), "--decode", str(args.decode),
           "--node-threads", str(threads), "--log-dir", str(work / f"logs-{label}")]
    if args.transfer_backend:
        cmd += ["--transfer-backend", args.transfer_backend]
    proc, url = start(cmd, work / f"{label}.log")
    out = work / f"{label}.jsonl"
    try:
        pdserve_main(["bench", "--base-url", url, "--backend", "generate",
                      "--num-prompts", str(args.num_prompts), "--request-rate",
                      str(args.rate), "--random-input-len", str(args.isl),
                      "--random-output-len", str(args.osl), "--random-range-ratio", "0",
                      "--ignore-eos", "--seed", str(args.seed), "--percentiles", "50,90",
                      "--output-file", str(out), "--disable-tqdm", "--label", label])
    finally:
        stop(proc)
    row = json.loads(out.read_text().splitlines()[-1])
    return {"setting": label, "threads": threads, "failed": row["failed"],
            **{k: round(float(row[k]), 2) for k in STATS}}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--transfer-backend", default="", choices=["", "tcp", "mooncake"])
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=0)
    p.add_argument("--repeats", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    args.num_prompts = args.num_prompts or (12 if args.quick else 32)
    args.repeats = args.repeats or (1 if args.quick else 2)
    cores = usable_cores()
    settings = [("split", split_cores(args.prefill + args.decode, cores)),
                ("per_core", cores)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="node-threads-") as tmp:
        for rep in range(args.repeats):
            for label, threads in settings:
                rows.append({"repeat": rep, **run(f"{label}-{rep}", threads, args, Path(tmp))})
    print_table(rows, ["setting", "threads", *STATS, "failed"])
    med = {label: {k: statistics.median(r[k] for r in rows
                                        if r["setting"].startswith(label + "-"))
                   for k in STATS} for label, _ in settings}
    summary = {"cores": cores, "nodes": args.prefill + args.decode,
               "threads": dict(settings), "median": med,
               "ratio_split_over_per_core": {
                   k: round(med["split"][k] / med["per_core"][k], 3)
                   for k in STATS if med["per_core"][k]},
               "failed": sum(r["failed"] for r in rows), "model": args.model,
               "loadavg_after": os.getloadavg()}
    print("summary:", json.dumps(summary))
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
