"""What a grammar costs (docs/architecture.md: Sampling): out tok/s of the same load with and
without a JSON schema (`pdserve bench --json-schema`), at concurrency 1 and 16, against one
`pdserve serve` node on its default flags. Modes alternate over `--rounds` so a loaded
machine skews both alike; the median per mode is reported.

The schema forces long outputs (an array of at least 20 objects), so every measured token
is sampled under the mask, none after the JSON is complete.

    python bench/structured.py [--quick] [--out bench/out/structured.json]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.ports import start_and_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 20, "items": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "tag": {"enum": ["alpha", "beta", "gamma"]}},
        "required": ["name", "score", "tag"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def start_node(model: str, log: Path) -> tuple[subprocess.Popen, int]:
    """`pdserve serve` on a port it picks (`--port 0 --port-file`); it and its port."""
    port_file = log.with_suffix(".port")
    try:
        return start_and_wait(
            lambda: subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--port",
                 "0", "--port-file", str(port_file)],
                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True),
            port_file, 300, name="node", log=log, poll_s=0.5)
    except (RuntimeError, TimeoutError) as exc:  # killed with its scheduler process
        raise SystemExit(str(exc)) from None


def bench(port: int, conc: int, prompts: int, args, schema: Path | None, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--base-url",
           f"http://127.0.0.1:{port}", "--backend", "openai", "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(prompts), "--max-concurrency",
           str(conc), "--warmup-requests", "1", "--disable-tqdm", "--output-file", str(out),
           "--seed", str(conc)]
    if schema is not None:
        cmd += ["--json-schema", str(schema)]
    out.unlink(missing_ok=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text().splitlines()[-1])


def main() -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrencies", default="1,16")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-conc", type=int, default=4, help="requests = this x conc")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.model, args.rounds, args.prompts_per_conc = "tiny-llama", 1, 2
        args.output_len = 32
    concs = [int(c) for c in args.concurrencies.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-structured-"))
    schema = tmp / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    node, port = start_node(args.model, tmp / "node.log")
    runs: dict[tuple[int, str], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for conc in concs:
                for mode in ("none", "json_schema"):
                    row = bench(port, conc, max(conc * args.prompts_per_conc, 2), args,
                                schema if mode == "json_schema" else None, tmp / "run.jsonl")
                    if row.get("failed") or row.get("completed", 1) == 0:
                        raise SystemExit(f"failed requests in {mode} c{conc}: {row}")
                    runs.setdefault((conc, mode), []).append(row["output_throughput"])
    finally:
        os.killpg(node.pid, 15)
        node.wait(timeout=30)
    rows, summary = [], {"model": args.model}
    for conc in concs:
        base = statistics.median(runs[(conc, "none")])
        constrained = statistics.median(runs[(conc, "json_schema")])
        rows.append({"concurrency": conc, "none_out_tok_s": base,
                     "json_schema_out_tok_s": constrained, "ratio": constrained / base})
        summary[f"c{conc}_ratio"] = constrained / base
        summary[f"c{conc}_none_out_tok_s"] = base
        summary[f"c{conc}_json_schema_out_tok_s"] = constrained
    print_table(rows, ["concurrency", "none_out_tok_s", "json_schema_out_tok_s", "ratio"])
    write_json(args.out, summary, rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
