"""What tensor parallelism costs on this CPU: the same greedy batch on TP1 and TP2 (gloo).

On a CPU node TP does not add compute (the ranks share the same cores) but adds, per
forward, one batch broadcast, two all-reduces per layer and one logits all-gather. This
script reports wall time, tokens/s and the ratio to TP1, and checks that the tokens are
identical (correctness is the point on a CPU; the speed figure is noise-prone on a shared
machine).

    python bench/tp.py [--quick] [--model tiny-llama] [--tp 2] [--out bench/out/tp.json]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402


def run(model: str, tp: int, prompts: list[list[int]], new_tokens: int) -> dict:
    llm = LLM(model, tp_size=tp, dtype="float32", max_total_tokens=16384,
              disable_overlap=True)
    try:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0]], SamplingParams(max_new_tokens=2))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        llm.close()
    tokens = sum(len(o.output_ids) for o in outs)
    return {"tp": tp, "wall_s": wall, "out_tok_s": tokens / wall,
            "ids": [o.output_ids for o in outs]}


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--tp", type=int, default=2, help="TP size compared with TP1")
    args = ap.parse_args()
    n, prompt_len, new = (4, 64, 16) if args.quick else (16, 256, 64)
    prompts = [[100 + (i * 7 + j) % 30000 for j in range(prompt_len)] for i in range(n)]
    rows = [run(args.model, tp, prompts, new) for tp in (1, args.tp)]
    same = rows[0]["ids"] == rows[1]["ids"]
    for r in rows:
        r.pop("ids")
        r["vs_tp1"] = r["wall_s"] / rows[0]["wall_s"]
    print(f"{args.model}: {n} prompts x {prompt_len} tokens, {new} new tokens, normal loop")
    print_table(rows, ["tp", "wall_s", "out_tok_s", "vs_tp1"])
    print(f"greedy tokens identical across TP sizes: {same}")
    write_json(args.out, {"identical": same, "tp_slowdown": rows[1]["vs_tp1"]}, rows, args)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
