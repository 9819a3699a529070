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

`--storage file|mooncake` adds a third row: node 1 computes every document once into a
storage tier (a folder, or a Mooncake Store on a `mooncake_master` started here), node 2
(fresh: empty device and host tiers) serves the later rounds from it.
`--pd` runs a multi-turn chat workload through the router of a local 1P1D stack instead
(bench/hicache_pd.py).

    python bench/hicache.py [--quick] [--workload docs|unique] [--storage file|mooncake]
    python bench/hicache.py --pd [--quick] [--out bench/out/hicache-pd.json]
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


def run_mode(args, hicache: bool, rounds, storage: dict | None = None, label: str = "",
             keep: list | None = None) -> dict:
    """One node over `rounds`; `storage`: its storage tier flags; `keep`: leave the node
    open there (a Mooncake Store loses the pages of a client that closes)."""
    total = args.docs * args.doc_tokens
    pool = max(int(total * args.pool_fraction), args.doc_tokens + 2 * args.q_tokens + 64)
    extra = storage or {}
    llm = LLM(args.model, max_total_tokens=pool, dtype="float32", loop=args.loop,
              enable_hierarchical_cache=hicache,
              hicache_ratio=max(2.0, 2.0 * total / pool), **extra)
    eng, params = llm.engine, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    ttft, outs, warm_tokens, warm_s = [], [], 0, 0.0
    deadline = time.monotonic() + 60  # a Mooncake client connects in the background
    while eng.page_store is not None and not eng.page_store.storage.up:
        if time.monotonic() > deadline:
            raise SystemExit("the storage tier did not come up in 60 s")
        time.sleep(0.1)
    try:
        warm = eng.add_request(f"warmup-{label}-{hicache}", list(range(7, 39)), params)
        while eng.has_work():  # a fresh engine's first forward is slow: not measured
            eng.step()
        eng.loop.drain()
        assert warm.output_ids
        for r, prompts in enumerate(rounds):
            for i, ids in enumerate(prompts):
                t0 = time.perf_counter()
                req = eng.add_request(f"r{r}-{i}-{hicache}", ids, params)
                while eng.has_work():
                    eng.step()
                eng.loop.drain()
                dt = req.first_token_time - req.arrival
                outs.append(req.output_ids[0])
                if r or label:  # storage rows: every round counts (a fresh node reads storage)
                    ttft.append(dt)
                    warm_tokens += len(ids)
                    warm_s += time.perf_counter() - t0
        stats = eng.memory_stats()
        if eng.page_store is not None:
            stats |= eng.page_store.stats
    finally:
        if keep is None:
            llm.close()
        else:
            keep.append(llm)
    # inclusive: with few samples p99 interpolates inside them instead of extrapolating
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else ttft * 99
    return {"hicache": label or ("on" if hicache else "off"), "pool_tokens": pool,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * q[98],
            "prompt_tok_s": warm_tokens / warm_s,
            "host_hit_tokens": stats.get("host_hit_tokens", 0),
            "storage_hit_tokens": stats.get("storage_hit_tokens", 0),
            "storage_errors": stats.get("storage_errors", 0),
            "storage_corrupt_pages": stats.get("storage_corrupt_pages", 0),
            "ttft_ms": [round(1000 * t) for t in ttft], "outputs": outs}


def run_storage(args, rounds) -> dict:
    """Node 1 computes every document once and writes the pages to the storage tier (a file
    folder, or a Mooncake Store on a mooncake_master started here); node 2, fresh (empty
    device and host tiers), serves the later rounds from it."""
    import shutil
    import tempfile

    from pdserve.stack.kv_store import start_master

    folder = Path(tempfile.mkdtemp(prefix="pdserve-hicache-storage-"))
    master, nodes = None, []
    try:
        if args.storage == "mooncake":
            master, flags = start_master(folder, time.monotonic() + 60)
            storage = {"hicache_storage_backend": "mooncake",
                       "hicache_mooncake_master": flags[1],
                       "hicache_mooncake_metadata_url": flags[3]}
        else:
            storage = {"hicache_storage_backend": "file", "hicache_storage_path": str(folder)}
        run_mode(args, True, rounds[:1], storage=storage, label="writer", keep=nodes)
        nodes[-1].engine.kv.drain_copies()  # every storage write has landed
        row = run_mode(args, True, rounds[1:], storage=storage, label="storage", keep=nodes)
    finally:
        for llm in nodes:
            llm.close()
        if master is not None:
            master.signal(15)
            master.wait_stopped(10)
            master.kill_tree()
        shutil.rmtree(folder, ignore_errors=True)
    return row


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
    p.add_argument("--storage", choices=("file", "mooncake"), default=None,
                   help="also a fresh node served from a storage tier another node filled "
                        "(the later rounds, against off)")
    pd = p.add_argument_group("--pd: multi-turn chat through the router")
    pd.add_argument("--pd", action="store_true", help="run the PD chat workload")
    pd.add_argument("--chats", type=int, default=8)
    pd.add_argument("--turns", type=int, default=6)
    pd.add_argument("--system-tokens", type=int, default=256)
    pd.add_argument("--user-tokens", type=int, default=32)
    pd.add_argument("--reply-tokens", type=int, default=96)
    pd.add_argument("--output-tokens", type=int, default=8)
    pd.add_argument("--hicache-ratio", type=float, default=4.0)
    args = p.parse_args()
    if args.pd:
        return main_pd(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.docs, args.doc_tokens, args.rounds = 8, 512, 2
    torch.manual_seed(0)
    rounds = workload(args.docs, args.doc_tokens, args.rounds, args.q_tokens,
                      args.workload == "unique")
    rows = [run_mode(args, False, rounds), run_mode(args, True, rounds)]
    same = rows[0]["outputs"] == rows[1]["outputs"]
    if args.storage:
        rows.append(run_storage(args, rounds))
        n = len(rounds[0])
        same = same and rows[2]["outputs"] == rows[0]["outputs"][n:]
    for r in rows:
        r.pop("outputs")
    print_table(rows, ["hicache", "pool_tokens", "ttft_p50_ms", "ttft_p99_ms", "prompt_tok_s",
                       "host_hit_tokens", "storage_hit_tokens"])
    summary = {"ttft_off_over_on": rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"],
               "ttft_p99_off_over_on": rows[0]["ttft_p99_ms"] / rows[1]["ttft_p99_ms"],
               "prompt_tok_s_on_over_off": rows[1]["prompt_tok_s"] / rows[0]["prompt_tok_s"],
               "same_first_tokens": same, "model": args.model, "workload": args.workload,
               "cpu": cpu_description()}
    if args.storage:
        summary["ttft_off_over_storage"] = rows[0]["ttft_p50_ms"] / rows[2]["ttft_p50_ms"]
        summary["ttft_p99_off_over_storage"] = rows[0]["ttft_p99_ms"] / rows[2]["ttft_p99_ms"]
    print(f"{cpu_description()}, {args.workload} workload")
    print(f"median TTFT off/on: {summary['ttft_off_over_on']:.2f}x; "
          f"first tokens identical: {same}")
    if args.storage:
        print(f"median TTFT off/storage (a fresh node): "
              f"{summary['ttft_off_over_storage']:.2f}x")
    write_json(args.out, summary, rows, args)
    return 0 if same else 1


def main_pd(args) -> int:
    from hicache_pd import run_pd

    if args.quick:
        args.chats, args.turns = 4, 4
    rows, summary = run_pd(args)
    summary |= {"model": args.model, "cpu": cpu_description()}
    print_table(rows, ["hicache", "prefill_pool_tokens", "ttft_p50_ms", "ttft_p99_ms",
                       "prompt_tok_s", "host_hit_tokens"])
    print(f"{cpu_description()}, multi-turn chat through the router (1P1D)")
    print(f"median TTFT off/on: {summary['ttft_off_over_on']:.2f}x; "
          f"outputs identical: {summary['same_outputs']}")
    write_json(args.out, summary, rows, args)
    return 0 if summary["same_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())
