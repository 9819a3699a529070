"""Normal vs overlapped scheduling on a decode-heavy steady state.

For each model and batch size, the same requests (fixed prompt, `ignore_eos`, fixed
output length) run once with the normal loop and once with the overlap loop, side by
side in one process. Reports TPOT (decode time per output token per request),
output tok/s and the scheduler thread's own CPU time per step.

    python bench/overlap.py [--quick] [--out bench/out/overlap.json]
    python bench/overlap.py --device cuda --dtype bfloat16 --models synthetic-1b \
        --batches 1,8,32,128 --out OUT.json      # on a GPU (scripts/gpu_check.sh)

`synthetic-1b` is a Llama-shaped ~1B-parameter model whose random weights are drawn on the
device at load time (pdserve/models/tiny.py); nothing is downloaded.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402


def measure(llm, prompts, params, out_len: int) -> dict:
    stats = llm.engine.loop.stats
    steps0, cpu0 = stats.steps, stats.sched_cpu_s
    fwd0 = llm.engine.executor.forward_cpu_s
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.output_ids) == out_len for o in outs)
    steps = stats.steps - steps0
    return {
        "tpot_ms": 1000 * elapsed / out_len,
        "out_tok_s": len(prompts) * out_len / elapsed,
        "sched_cpu_us_step": 1e6 * (stats.sched_cpu_s - cpu0) / max(steps, 1),
        "fwd_cpu_us_step": 1e6 * (llm.engine.executor.forward_cpu_s - fwd0) / max(steps, 1),
        "steps": steps,
    }


def run_pair(model: str, batch: int, out_len: int, repeats: int,
             engine_kw: dict | None = None) -> list[dict]:
    """Both loops on the same requests, measured alternately so that drifting machine load
    hits both alike; the best (lowest TPOT) repeat of each is kept."""
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] * 4 for i in range(batch)]
    params = SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    # KV room for every request's prompt + output (+ a page each), whatever the model.
    kw = {"max_total_tokens": max(4096, batch * (16 + out_len + 32)), **(engine_kw or {})}
    llms = {loop: LLM(model, loop=loop, max_running_requests=max(batch, 8), **kw)
            for loop in ("normal", "overlap")}
    best: dict[str, dict] = {}
    for llm in llms.values():
        llm.generate(prompts, warm)
    for _ in range(repeats):
        for loop, llm in llms.items():
            row = measure(llm, prompts, params, out_len)
            if loop not in best or row["tpot_ms"] < best[loop]["tpot_ms"]:
                best[loop] = row
    rows = []
    for loop, llm in llms.items():
        rows.append({"model": model, "batch": batch, "loop": loop, **best[loop],
                     "overlap_disabled": dict(llm.engine.loop.stats.overlap_disabled)})
        llm.close()
    return rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-llama,smollm2-135m")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both loops (0: torch default); on a "
                             "shared 2-core machine more threads make small steps noisy")
    parser.add_argument("--device", default="cpu", help="cpu|cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto|bfloat16|float16|float32")
    parser.add_argument("--out-len", type=int, default=0,
                        help="output tokens per request (0: 64 with --quick, else 256)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="measured repeats per loop (0: 3 with --quick, else 5)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out_len = args.out_len or (64 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 5)
    engine_kw = {"device": args.device, "dtype": args.dtype}
    rows = []
    for model in args.models.split(","):
        for bs in [int(b) for b in args.batches.split(",")]:
            rows.extend(run_pair(model, bs, out_len, repeats, engine_kw))
            print(f"  {model} bs={bs}: normal {rows[-2]['tpot_ms']:.2f} ms, "
                  f"overlap {rows[-1]['tpot_ms']:.2f} ms")
    summary = {}
    for model in args.models.split(","):
        tag = {"tiny-llama": "tiny", "synthetic-1b": "1b"}.get(model, model.split("-")[0])
        for bs in [int(b) for b in args.batches.split(",")]:
            pair = {r["loop"]: r for r in rows if r["model"] == model and r["batch"] == bs}
            ratio = pair["normal"]["tpot_ms"] / pair["overlap"]["tpot_ms"]
            summary[f"tpot_ratio_bs{bs}_{tag}"] = round(ratio, 3)
            # Best case if the two threads never contended (for the GIL or the cores):
            # a step costs max(scheduler, forward) instead of their sum.
            s, f = pair["normal"]["sched_cpu_us_step"], pair["normal"]["fwd_cpu_us_step"]
            summary[f"ideal_ratio_bs{bs}_{tag}"] = round((s + f) / max(s, f), 3)
            summary[f"decode_tok_s_bs{bs}_{tag}"] = round(pair["overlap"]["out_tok_s"], 1)
    print_table(rows, ["model", "batch", "loop", "tpot_ms", "out_tok_s", "sched_cpu_us_step",
                       "fwd_cpu_us_step", "steps"])
    print("normal/overlap TPOT ratios:", summary)
    summary["device"] = args.device
    if args.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
