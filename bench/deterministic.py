"""The cost of `--enable-deterministic-inference`: output tok/s with and without the flag,
at concurrency 1 and 16, bfloat16, default engine flags otherwise, side by side in one
process. Each batch also checks the flag's promise: every request's tokens equal those of
the same prompt run alone (`alone_equal`; without the flag it may be False).

    python bench/deterministic.py [--quick] [--out bench/out/deterministic.json]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run(model: str, deterministic: bool, concurrencies: list[int], prompt_len: int,
        out_len: int, repeats: int) -> list[dict]:
    llm = LLM(model, dtype="bfloat16", enable_deterministic_inference=deterministic)
    params = SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True)
    rows = []
    try:
        llm.generate(prompts(2, prompt_len, 99), params)  # warm-up
        for c in concurrencies:
            batch = prompts(c, prompt_len, seed=c)
            best, outs = None, None
            for _ in range(repeats):
                llm.engine.flush_cache()
                t0 = time.perf_counter()
                outs = llm.generate(batch, params)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            llm.engine.flush_cache()
            alone = llm.generate(batch[0], params)[0].output_ids
            rows.append({"model": model, "deterministic": deterministic, "concurrency": c,
                         "out_tok_s": c * out_len / best, "e2e_s": best,
                         "alone_equal": alone == outs[0].output_ids})
    finally:
        llm.close()
    return rows


def main() -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if args.quick:
        args.prompt_len, args.out_len, args.repeats = 128, 32, 1
    cs = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for det in (False, True):
        rows += run(args.model, det, cs, args.prompt_len, args.out_len, args.repeats)
    print_table(rows, ["model", "deterministic", "concurrency", "out_tok_s", "e2e_s",
                       "alone_equal"])
    summary = {}
    for c in cs:
        off = next(r for r in rows if r["concurrency"] == c and not r["deterministic"])
        on = next(r for r in rows if r["concurrency"] == c and r["deterministic"])
        summary[f"slowdown_c{c}"] = off["out_tok_s"] / on["out_tok_s"]
        summary[f"out_tok_s_c{c}_off"] = off["out_tok_s"]
        summary[f"out_tok_s_c{c}_on"] = on["out_tok_s"]
        summary[f"alone_equal_c{c}_on"] = on["alone_equal"]
    print("summary:", {k: round(v, 3) if isinstance(v, float) else v
                       for k, v in summary.items()})
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
