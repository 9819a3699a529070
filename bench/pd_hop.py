"""The fixed cost of disaggregation: 1P1D minus colocated p50 TTFT at low load.

Both stacks run on default flags (`pdserve up` 1P1D, `pdserve serve`) on this machine's
cores and get the same seeded requests: short prompts (64 tokens), 4 output tokens, sent
one at a time (`--max-concurrency 1`) at 5 req/s. The untraced rounds alternate the two
live stacks, the same requests for both within a round; the overhead is the median over
rounds of (PD p50 TTFT - colocated p50 TTFT). A traced pair of stacks
(`--otlp-traces-endpoint` to the receiver of `pdserve bench --trace-breakdown`) then says
where the time goes, hop by hop. Tracing adds to both, more to PD (three processes make
spans, not one), so the overhead is taken untraced and the traced one is shown beside it.

    python bench/pd_hop.py [--quick] [--rounds N] [--out bench/out/pd_hop.json]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402
from pd_vs_colocated import bench_record, start, stop  # noqa: E402

from pdserve.loadtest.trace_breakdown import HOPS  # noqa: E402
from pdserve.ports import free_port  # noqa: E402

SYSTEMS = ("colocated", "disaggregated")


def stack_cmd(system: str, args, workdir: Path, endpoint: str) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli"]
    if system == "colocated":
        cmd += ["serve", "--model", args.model]
    else:
        cmd += ["up", "--model", args.model, "--transfer-backend", args.transfer_backend,
                "--log-dir", str(workdir / f"up-logs{'-traced' if endpoint else ''}")]
    return cmd + (["--otlp-traces-endpoint", endpoint] if endpoint else [])


def run_bench(url: str, label: str, out: Path, args, seed: int, receiver_port: int) -> dict:
    """One paced low-load run; its JSON record (with `trace_hops` when traced)."""
    argv = ["bench", "--base-url", url, "--label", label, "--output-file", str(out),
            "--seed", str(seed), "--disable-tqdm", "--num-prompts", str(args.prompts),
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--request-rate", str(args.rate),
            "--max-concurrency", "1", "--warmup-requests", "5"]
    if receiver_port:
        argv += ["--trace-breakdown", "--trace-receiver-port", str(receiver_port)]
    return bench_record(argv, out, label)


def hop_p50s(record: dict) -> dict[str, float]:
    """p50 (ms) of each hop of the TTFT path in a traced bench record."""
    path = (record.get("trace_hops") or {}).get("ttft_path") or {}
    return {hop: v["p50_ms"] for hop, v in path.items()}


def summarize(rounds: list[dict[str, float]], traced: dict[str, dict] | None,
              goal_ms: float) -> dict:
    """`rounds`: per untraced round, each system's p50 TTFT (ms); `traced`: each system's
    traced bench record, or None."""
    diffs = [r["disaggregated"] - r["colocated"] for r in rounds]
    summary: dict = {
        "overhead_p50_ms": round(statistics.median(diffs), 2),
        "overhead_range_ms": [round(min(diffs), 2), round(max(diffs), 2)],
        "rounds": len(rounds),
        **{f"{s}_p50_ttft_ms": round(statistics.median(r[s] for r in rounds), 2)
           for s in SYSTEMS},
        "goal_ms": goal_ms,
    }
    summary["goal_met"] = summary["overhead_p50_ms"] <= goal_ms
    if traced is not None:
        summary["traced_overhead_p50_ms"] = round(
            traced["disaggregated"]["median_ttft_ms"] - traced["colocated"]["median_ttft_ms"], 2)
        summary["hops_p50_ms"] = {s: hop_p50s(traced[s]) for s in SYSTEMS}
    return summary


def hop_rows(hops: dict[str, dict[str, float]]) -> list[dict]:
    """One row per hop, in the order a PD request passes them (colocated hops slot in)."""
    order = [h for h in HOPS if any(h in hops.get(s, {}) for s in SYSTEMS)]
    return [{"hop": h, **{s: hops.get(s, {}).get(h) for s in SYSTEMS}} for h in order]


def run_pair(args, workdir: Path, endpoint: str, receiver_port: int, rounds: int,
             rows: list[dict]) -> list[dict[str, dict]]:
    """Start both stacks, alternate `rounds` bench runs on them; each round's records."""
    procs: dict[str, tuple] = {}
    tag = "traced" if endpoint else "untraced"
    try:
        for system in SYSTEMS:
            procs[system] = start(stack_cmd(system, args, workdir, endpoint),
                                  workdir / f"{system}-{tag}.log")
        out: list[dict[str, dict]] = []
        for i in range(rounds):
            got: dict[str, dict] = {}
            # Alternate who goes first, so a drift in the machine's load hits both.
            for system in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:
                got[system] = rec = run_bench(procs[system][1], f"{system}-{tag}-{i}",
                                              workdir / f"{system}.jsonl", args, seed=i + 1,
                                              receiver_port=receiver_port)
                rows.append({"round": i, "system": system, "traced": bool(endpoint),
                             "failed": rec["failed"], "p50_ttft_ms": rec["median_ttft_ms"],
                             "p90_ttft_ms": rec["p90_ttft_ms"],
                             "p50_tpot_ms": rec["median_tpot_ms"]})
            out.append(got)
        return out
    finally:
        for proc, _ in procs.values():
            stop(proc)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "tcp"])
    parser.add_argument("--rounds", type=int, default=0,
                        help="untraced rounds (default 5; --quick: 1)")
    parser.add_argument("--prompts", type=int, default=0,
                        help="requests per run (default 80; --quick: 40)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--no-trace", action="store_true", help="skip the traced pair")
    parser.add_argument("--goal-ms", type=float, default=5.0)
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.prompts = args.prompts or (40 if args.quick else 80)
    load1 = os.getloadavg()[0]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pd-hop-") as tmp:
        work = Path(tmp)
        rounds = run_pair(args, work, "", 0, args.rounds, rows)
        traced = None
        if not args.no_trace:
            port = free_port()
            traced = run_pair(args, work, f"http://127.0.0.1:{port}", port, 1, rows)[0]
    print_table(rows, ["round", "system", "traced", "failed", "p50_ttft_ms", "p90_ttft_ms",
                       "p50_tpot_ms"])
    if any(r["failed"] for r in rows):
        print("warning: some requests failed; the overhead below is not meaningful")
    summary = summarize([{s: r[s]["median_ttft_ms"] for s in SYSTEMS} for r in rounds],
                        traced, args.goal_ms)
    summary |= {"model": args.model, "transfer_backend": args.transfer_backend,
                "load1_before": round(load1, 2)}
    if traced is not None:
        print("\nTTFT path of the traced pair, p50 per hop (ms):")
        print_table(hop_rows(summary["hops_p50_ms"]), ["hop", *SYSTEMS])
    print("\nsummary:", {k: v for k, v in summary.items() if k != "hops_p50_ms"})
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
