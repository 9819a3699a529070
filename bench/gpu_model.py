"""A big model's speed on one device, beside its physical limit (scripts/gpu_check.sh).

One engine with the node's default settings (KV pool from --mem-fraction-static on CUDA,
the default attention backend, CUDA graphs, the automatic loop) serving `synthetic-8b`
(Llama-3-8B's shape, random bf16 weights drawn on the GPU: nothing to download) measures

- decode: time per step and tok/s at each batch x context (rows share one cached prompt,
  so a point costs one prefill; each row still reads its whole context every step);
- prefill: tok/s of unique long prompts;
- the mixed-batch probe: a fresh long prompt arriving while many requests decode at a long
  context, run as mixed batches (its chunks plus every decode row): the peak memory above
  the engine's own (weights and KV pool);
- memory: the share of the card in use once the engine is built;

and states the limit beside them: a batch-1 decode step reads every weight once, so it
cannot beat weight bytes / HBM bandwidth (~14.8 GB / 4.8 TB/s = 3.1 ms on an H200).

    python bench/gpu_model.py --device cuda --out OUT.json   # on the GPU (~2 minutes)
    python bench/gpu_model.py --quick                        # the same at tiny size on CPU
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402

# HBM bandwidth by device name (vendor data sheets, bytes/s); the first match wins.
HBM_BYTES_S = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12),
               ("H100", 3.35e12), ("A100", 2.0e12), ("L40S", 0.864e12), ("L4", 0.3e12))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    sync(llm)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    sync(llm)
    return time.perf_counter() - t0


def sync(llm: LLM) -> None:
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize(llm.engine.device)


def decode_point(llm: LLM, rng: random.Random, batch: int, context: int, steps: int) -> dict:
    """Step time of `batch` rows at `context` tokens: (time of 1 + steps tokens - time of
    1 token) / steps, after a warm-up that caches the shared prompt."""
    prompt = [rng.randrange(100, 40000) for _ in range(context)]
    prompts = [prompt] * batch
    llm.generate(prompts, greedy(2))  # prefill once (cached), graphs and kernels warm
    # Each the better of two: a one-off stall (allocator, GC) is not speed.
    first = min(timed(llm, prompts, greedy(1)) for _ in range(2))
    total = min(timed(llm, prompts, greedy(1 + steps)) for _ in range(2))
    step_s = max(total - first, 1e-9) / steps
    return {"what": "decode", "batch": batch, "context": context,
            "tpot_ms": round(1e3 * step_s, 3), "tok_s": round(batch / step_s, 1)}


def prefill_point(llm: LLM, rng: random.Random, n: int, length: int) -> dict:
    prompts = [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]
    secs = timed(llm, prompts, greedy(1))
    return {"what": "prefill", "batch": n, "context": length,
            "tok_s": round(n * length / secs, 1), "seconds": round(secs, 3)}


def mixed_probe(llm: LLM, rng: random.Random, rows: int, context: int, chunk: int) -> dict:
    """`rows` requests decoding at `context` tokens, then (FCFS, so once they decode) a
    fresh prompt of `chunk` tokens: its prefill runs as mixed batches. Peak memory above
    what the engine held before (CUDA; None on CPU, which keeps no allocator stats)."""
    prefix = [rng.randrange(100, 40000) for _ in range(context - 1)]
    prompts = [prefix + [100 + i] for i in range(rows)]
    prompts.append([rng.randrange(100, 40000) for _ in range(chunk)])
    cuda = llm.engine.device.type == "cuda"
    if cuda:
        sync(llm)
        torch.cuda.reset_peak_memory_stats(llm.engine.device)
        base = torch.cuda.memory_allocated(llm.engine.device)
    mixed0 = llm.engine.sched.num_mixed_batches
    secs = timed(llm, prompts, greedy(max(16, chunk // 64)))
    peak = torch.cuda.max_memory_allocated(llm.engine.device) - base if cuda else None
    return {"what": "mixed_probe", "batch": rows, "context": context, "chunk": chunk,
            "mixed_batches": llm.engine.sched.num_mixed_batches - mixed0,
            "peak_gb": None if peak is None else round(peak / 2**30, 3),
            "seconds": round(secs, 3)}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic-8b")
    p.add_argument("--device", default="cpu", help="cpu|cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's on CUDA)|bfloat16|...")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per point")
    p.add_argument("--prefill", default="8x4096", help="N x LENGTH unique prompts")
    p.add_argument("--probe", default="32x2048+2048",
                   help="ROWS x CONTEXT + CHUNK of the mixed-batch probe")
    p.add_argument("--engine", default="",
                   help="extra EngineConfig fields, e.g. 'max_total_tokens=8192,page_size=16'")
    args = p.parse_args()
    if args.quick:  # the CPU dry run: same steps, tiny shapes
        args.model, args.batches, args.contexts, args.steps = "synthetic-tiny", "1,4", "64,128", 4
        args.prefill, args.probe = "2x128", "4x64+64"
        args.engine = args.engine or "max_total_tokens=4096,chunked_prefill_size=64," \
                                     "max_prefill_tokens=64"
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    n_pre, len_pre = (int(x) for x in args.prefill.split("x"))
    rows_ctx, chunk = args.probe.split("+")
    probe_rows, probe_ctx = (int(x) for x in rows_ctx.split("x"))
    kw = {k: _value(v) for k, v in (kv.split("=") for kv in args.engine.split(",") if kv)}
    kw.setdefault("max_running_requests", max(64, max(batches), probe_rows + 1))

    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **kw)
    load_s = time.perf_counter() - t0
    dev = llm.engine.device
    weights = sum(t.numel() * t.element_size() for t in llm.engine.loaded.model.parameters())
    used = None
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        used = round(1 - free / total, 3)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
    bandwidth = next((bw for name, bw in HBM_BYTES_S if name in gpu), None)
    describe = llm.engine.describe()
    rng = random.Random(0)
    rows = []
    try:
        for ctx in contexts:
            for b in batches:
                rows.append(decode_point(llm, rng, b, ctx, args.steps))
                print(f"  decode bs={b} ctx={ctx}: {rows[-1]['tpot_ms']} ms/step", flush=True)
        rows.append(prefill_point(llm, rng, n_pre, len_pre))
        rows.append(mixed_probe(llm, rng, probe_rows, probe_ctx, int(chunk)))
        pools_full = llm.engine.pools_full()
    finally:
        llm.close()
    print_table(rows, ["what", "batch", "context", "chunk", "tpot_ms", "tok_s", "mixed_batches",
                       "peak_gb", "seconds"])

    summary: dict = {
        "model": args.model, "device": str(dev), "gpu": gpu, "dtype": describe["dtype"],
        "attention_backend": describe["attention_backend"], "loop": describe["loop"],
        "cuda_graphs": describe["cuda_graphs"], "kv_pool": describe["kv_pool_reason"],
        "load_s": round(load_s, 1), "weight_gb": round(weights / 1e9, 2),
        "memory_used_fraction": used, "pools_full_after": pools_full}
    for r in rows:
        if r["what"] == "decode":
            key = f"bs{r['batch']}_ctx{r['context']}"
            summary[f"tpot_ms_{key}"] = r["tpot_ms"]
            summary[f"decode_tok_s_{key}"] = r["tok_s"]
    summary["prefill_tok_s"] = rows[-2]["tok_s"]
    summary["probe_peak_gb"] = rows[-1]["peak_gb"]
    summary["probe_mixed_batches"] = rows[-1]["mixed_batches"]
    if bandwidth:
        limit_ms = 1e3 * weights / bandwidth
        b1 = summary.get(f"tpot_ms_bs1_ctx{contexts[0]}")
        summary["hbm_tb_s"] = bandwidth / 1e12
        summary["batch1_limit_ms"] = round(limit_ms, 3)
        summary["batch1_tpot_over_limit"] = round(b1 / limit_ms, 2) if b1 else None
        summary["goal_batch1_within_1p5x"] = bool(b1 and b1 <= 1.5 * limit_ms)
    if used is not None:
        summary["goal_memory_used_ge_0p85"] = used >= 0.85
    print({k: v for k, v in summary.items() if not isinstance(v, dict)})
    write_json(args.out, summary, rows, args)


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    main()
