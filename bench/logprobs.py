"""What logprobs cost (docs/architecture.md: Logprobs): the same batch of requests run with no
logprobs, with output logprobs (top 5, top 20) and with prompt logprobs too, in one
process, interleaved over several rounds (the median is reported, so a loaded machine
skews every mode alike). "off" is the path every request without logprobs takes: it must
not be slower than before logprobs existed (its per-batch cost is one `None` check).

    python bench/logprobs.py [--quick] [--out bench/out/logprobs.json]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402

MODES = {"off": {}, "top5": {"logprobs": 5}, "top20": {"logprobs": 20},
         "top5+prompt": {"logprobs": 5, "prompt_logprobs": 5}}


def run_once(llm: LLM, prompts, out_len: int, extra: dict) -> tuple[float, float]:
    """(wall seconds, process CPU seconds): on a shared machine the CPU time is the steadier
    measure of the work done; the wall time is what a user sees."""
    params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True, **extra)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(len(o.output_ids) == out_len for o in outs)
    return elapsed, cpu


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    if args.quick:
        args.model, args.batch, args.out_len, args.rounds = "tiny-llama", 8, 32, 3
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_total_tokens=16384, dtype="float32", disable_prefix_cache=True)
    vocab = llm.engine.loaded.hf_config.vocab_size
    prompts = [[(101 + 7919 * (i * args.prompt_len + j)) % (vocab - 101) + 100
                for j in range(args.prompt_len)] for i in range(args.batch)]
    run_once(llm, prompts, 4, {})  # warm-up
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode, extra in MODES.items():
            times[mode].append(run_once(llm, prompts, args.out_len, extra))
    llm.close()
    base = statistics.median(t[0] for t in times["off"])
    base_cpu = statistics.median(t[1] for t in times["off"])
    rows = []
    for mode in MODES:
        med = statistics.median(t[0] for t in times[mode])
        cpu = statistics.median(t[1] for t in times[mode])
        rows.append({"mode": mode, "median_s": med, "cpu_s": cpu,
                     "out_tok_s": args.batch * args.out_len / med,
                     "vs_off": med / base, "cpu_vs_off": cpu / base_cpu})
    print(f"{args.model}, batch {args.batch}, prompt {args.prompt_len}, output "
          f"{args.out_len}, {args.rounds} rounds, {args.threads} threads")
    print_table(rows, ["mode", "median_s", "cpu_s", "out_tok_s", "vs_off", "cpu_vs_off"])
    summary = {r["mode"]: {k: r[k] for k in ("out_tok_s", "vs_off", "cpu_vs_off")}
               for r in rows}
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
