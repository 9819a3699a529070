"""HiCache on vs off on a shared-document workload bigger than the device KV pool.

`--docs` documents of `--doc-tokens` tokens each are asked questions in rounds (every
document once per round, in the same order): the documents together are several times
the device pool (`--pool-fraction`), so without a host tier LRU eviction drops each
document before its next question and every prompt is recomputed; with HiCache the
evicted prefixes stay in host memory (`--hicache-ratio` sized to hold them all) and are
loaded back. Requests run one at a time (TTFT = admission to first token, no queueing);
the first round is cold in both modes and left out of the comparison.
`--workload unique` gives every request a document of its own: no prefix is ever reused,
so HiCache can only cost (its backups), which is what that workload measures.

    python bench/hicache.py [--quick] [--workload docs|unique] [--out bench/out/hicache.json]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.cpus import cpu_description  # noqa: E402


def workload(docs: int, doc_tokens: int, rounds: int, q_tokens: int,
             unique: bool = False) -> list[list[list[int]]]:
    rng = random.Random(0)

    def doc() -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(doc_tokens)]

    texts = [doc() for _ in range(docs)]
    return [[(doc() if unique else t) + [rng.randrange(100, 30000) for _ in range(q_tokens)]
             for t in texts] for _ in range(rounds)]


def run_mode(args, hicache: bool, rounds) -> dict:
    total = args.docs * args.doc_tokens
    pool = max(int(total * args.pool_fraction), args.doc_tokens + 2 * args.q_tokens + 64)
    llm = LLM(args.model, max_total_tokens=pool, dtype="float32", loop=args.loop,
              enable_hierarchical_cache=hicache,
              hicache_ratio=max(2.0, 2.0 * total / pool))
    eng, params = llm.engine, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    ttft, outs, warm_tokens, warm_s = [], [], 0, 0.0
    try:
        for r, prompts in enumerate(rounds):
            for i, ids in enumerate(prompts):
                t0 = time.perf_counter()
                req = eng.add_request(f"r{r}-{i}-{hicache}", ids, params)
                while eng.has_work():
                    eng.step()
                eng.loop.drain()
                dt = req.first_token_time - req.arrival
                outs.append(req.output_ids[0])
                if r:
                    ttft.append(dt)
                    warm_tokens += len(ids)
                    warm_s += time.perf_counter() - t0
        stats = eng.memory_stats()
    finally:
        llm.close()
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else ttft * 99
    return {"hicache": "on" if hicache else "off", "pool_tokens": pool,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * q[98],
            "prompt_tok_s": warm_tokens / warm_s,
            "host_hit_tokens": stats.get("host_hit_tokens", 0), "outputs": outs}


def main() -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--q-tokens", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="device KV pool as a fraction of all documents' tokens")
    p.add_argument("--workload", choices=("docs", "unique"), default="docs",
                   help="docs: documents asked again each round; unique: no prefix reused")
    p.add_argument("--loop", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.docs, args.doc_tokens, args.rounds = 8, 512, 2
    torch.manual_seed(0)
    rounds = workload(args.docs, args.doc_tokens, args.rounds, args.q_tokens,
                      args.workload == "unique")
    rows = [run_mode(args, False, rounds), run_mode(args, True, rounds)]
    same = rows[0]["outputs"] == rows[1]["outputs"]
    for r in rows:
        r.pop("outputs")
    print_table(rows, ["hicache", "pool_tokens", "ttft_p50_ms", "ttft_p99_ms", "prompt_tok_s",
                       "host_hit_tokens"])
    summary = {"ttft_off_over_on": rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"],
               "ttft_p99_off_over_on": rows[0]["ttft_p99_ms"] / rows[1]["ttft_p99_ms"],
               "prompt_tok_s_on_over_off": rows[1]["prompt_tok_s"] / rows[0]["prompt_tok_s"],
               "same_first_tokens": same, "model": args.model, "workload": args.workload,
               "cpu": cpu_description()}
    print(f"{cpu_description()}, {args.workload} workload")
    print(f"median TTFT off/on: {summary['ttft_off_over_on']:.2f}x; "
          f"first tokens identical: {same}")
    write_json(args.out, summary, rows, args)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
