"""Disaggregated (`pdserve up` 1P1D) vs colocated (`pdserve serve`) on one workload.

The workload is prefill-heavy and bursty: long prompts arrive in bursts (gamma arrivals,
burstiness < 1) while earlier requests are still decoding, which is where a colocated
engine stalls its decode batch behind prefill batches. Each system also runs a low-load
pass (one request at a time) for the TTFT cost of the extra hop and the KV transfer.
Both stacks run on this machine, one after the other, with the same seeded requests.

    python bench/pd_vs_colocated.py [--quick] [--out bench/out/pd_vs_colocated.json]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from pdserve.ports import start_and_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve.cli import main as pdserve_main  # noqa: E402


def start(cmd: list[str], log: Path, timeout_s: float = 900) -> tuple[subprocess.Popen, str]:
    """Start `cmd` (`pdserve serve` or `up`) on a port it picks (`--port 0 --port-file`,
    added here); the process and its URL once a real request round-trips."""
    port_file = log.with_suffix(".port")
    cmd = [*cmd, "--port", "0", "--port-file", str(port_file)]
    proc, port = start_and_wait(
        lambda: subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                 start_new_session=True),
        port_file, timeout_s, name=f"pdserve {cmd[3]}", ready=_round_trips, log=log, stop=stop,
        poll_s=1)
    return proc, f"http://127.0.0.1:{port}"


def _round_trips(url: str) -> bool:
    """Ready = a real request round-trips (the router is up before its nodes)."""
    try:
        r = httpx.post(f"{url}/generate", timeout=30, json={
            "input_ids": [100, 200, 300], "sampling_params": {"max_new_tokens": 2}})
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(url: str, label: str, out: Path, args, low_load: bool) -> dict:
    argv = ["bench", "--base-url", url, "--backend", "generate", "--label", label,
            "--output-file", str(out), "--seed", "7", "--disable-tqdm",
            "--random-range-ratio", "0.5"]
    if low_load:
        argv += ["--num-prompts", str(args.low_prompts), "--max-concurrency", "1",
                 "--random-input-len", str(args.input_len), "--random-output-len", "8"]
    else:
        argv += ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
                 "--burstiness", "0.3", "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len)]
    return bench_record(argv, out, label)


def bench_record(argv: list[str], out: Path, label: str) -> dict:
    """Run `pdserve bench` with `argv` (its --output-file is `out`) in this process; the
    JSON record it appended."""
    before = len(out.read_text().splitlines()) if out.exists() else 0
    pdserve_main(argv)
    lines = out.read_text().splitlines()
    if len(lines) <= before:
        raise RuntimeError(f"bench wrote no result for {label}")
    return json.loads(lines[-1])


def run_system(kind: str, args, workdir: Path) -> tuple[dict, dict]:
    common = ["--model", args.model]
    if kind == "colocated":
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", *common]
    else:
        cmd = [sys.executable, "-m", "pdserve.cli", "up", *common,
               "--prefill", "1", "--decode", "1", "--transfer-backend", args.transfer_backend,
               "--log-dir", str(workdir / "up-logs")]
    proc, url = start(cmd, workdir / f"{kind}.log")
    try:
        out = workdir / f"{kind}.jsonl"
        low = bench(url, f"{kind}-low", out, args, low_load=True)
        high = bench(url, kind, out, args, low_load=False)
    finally:
        stop(proc)
    return low, high


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "tcp"])
    args = parser.parse_args()
    args.model = args.model or ("tiny-llama" if args.quick else "smollm2-135m")
    args.num_prompts, args.rate = (24, 6.0) if args.quick else (64, 4.0)
    args.input_len, args.output_len = (768, 48) if args.quick else (1024, 96)
    args.low_prompts = 4 if args.quick else 8
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="pd-vs-colo-") as tmp:
        for kind in ("colocated", "disaggregated"):
            low, high = run_system(kind, args, Path(tmp))
            results[kind] = (low, high)
            for phase, r in (("low-load", low), ("bursty", high)):
                rows.append({"system": kind, "phase": phase, "completed": r["completed"],
                             "failed": r["failed"], "p50_ttft_ms": r["median_ttft_ms"],
                             "p99_ttft_ms": r["p99_ttft_ms"], "p50_tpot_ms": r["median_tpot_ms"],
                             "p99_tpot_ms": r["p99_tpot_ms"]})
    print_table(rows, ["system", "phase", "completed", "failed", "p50_ttft_ms", "p99_ttft_ms",
                       "p50_tpot_ms", "p99_tpot_ms"])
    colo, dis = results["colocated"], results["disaggregated"]
    if any(r["failed"] for r in rows):
        print("warning: some requests failed; the ratios below are not meaningful")
    summary = {
        "p99_tpot_colocated_over_disagg": round(colo[1]["p99_tpot_ms"] /
                                                max(dis[1]["p99_tpot_ms"], 1e-9), 3),
        "ttft_disagg_over_colocated_low_load": round(dis[0]["median_ttft_ms"] /
                                                     max(colo[0]["median_ttft_ms"], 1e-9), 3),
        "model": args.model, "transfer_backend": args.transfer_backend,
    }
    print("summary:", summary)
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
