"""pdserve vs transformers `generate` on a mixed-length workload (output tok/s).

transformers runs static batches (left-padded, each batch generating until its longest
request's length); pdserve runs the same requests with continuous batching. Only the
requested output tokens count for both. Same dtype, same machine, same run.

    python bench/vs_hf.py [--quick] [--out bench/out/vs_hf.json]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402


def workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*in_range)
        reqs.append(([rng.randint(100, 40000) for _ in range(plen)], rng.randint(*out_range)))
    return reqs


def run_pdserve(model: str, reqs, dtype: str) -> float:
    from pdserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_running_requests=64, disable_prefix_cache=True)
    llm.generate([r[0] for r in reqs[:2]], SamplingParams(max_new_tokens=2, temperature=0))
    params = [SamplingParams(max_new_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r[0] for r in reqs], params)
    elapsed = time.perf_counter() - t0
    assert [len(o.output_ids) for o in outs] == [o for _, o in reqs]
    llm.close()
    return elapsed


def run_hf(model: str, reqs, dtype: str, batch_size: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.models.builtin import resolve_model

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    m = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch_dtype).eval()
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.inference_mode():
            m.generate(ids, attention_mask=mask, max_new_tokens=max(o for _, o in chunk),
                       min_new_tokens=max(o for _, o in chunk), do_sample=False, pad_token_id=2)
    return time.perf_counter() - t0


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    args = parser.parse_args()
    if args.quick:
        reqs = workload(12, (32, 160), (16, 48))
    else:
        reqs = workload(args.num_prompts, (32, 512), (16, 256))
    out_tokens = sum(o for _, o in reqs)
    t_pd = run_pdserve(args.model, reqs, args.dtype)
    t_hf = run_hf(args.model, reqs, args.dtype, args.hf_batch_size)
    rows = [
        {"system": "pdserve", "seconds": t_pd, "out_tok_s": out_tokens / t_pd},
        {"system": f"transformers (static bs={args.hf_batch_size})", "seconds": t_hf,
         "out_tok_s": out_tokens / t_hf},
    ]
    print_table(rows, ["system", "seconds", "out_tok_s"])
    summary = {"speedup_vs_hf": round(t_hf / t_pd, 3), "requests": len(reqs),
               "output_tokens": out_tokens}
    print("summary:", summary)
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
