"""The model forward alone: decode step time against the memory-bandwidth bound, and
prefill throughput, per dtype and batch size.

A decode step must read every weight once, so `weight bytes / step time` cannot exceed
the machine's memory bandwidth (measured here as a large `copy_`, which reads and writes:
we report its read rate). The ratio says how much of a step is unavoidable weight traffic
and how much is everything else (attention, op overhead). Prefill is compute-bound:
reported as prompt tokens/s of one long prompt.

    python bench/forward.py [--quick] [--model smollm2-135m] [--out bench/out/forward.json]
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import base_parser, print_table, write_json  # noqa: E402

from pdserve.memory.kv_pool import KVLayout, KVPool  # noqa: E402
from pdserve.models.llama import AttnMeta  # noqa: E402
from pdserve.models.loader import load_model  # noqa: E402
from pdserve.models.ops import choose_ops  # noqa: E402

PAGE = 16


def best_of(fn, reps: int) -> float:
    """Lowest wall time of `reps` calls after two warm-up calls (noise only adds time)."""
    fn()
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_read_gbs(mib: int = 256) -> float:
    src = torch.empty(mib << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return (mib / 1024) / best_of(lambda: dst.copy_(src), 5)


def meta_for(rows: int, q_len: int, ctx: int, paged: bool = False, extend: bool = False
             ) -> tuple[AttnMeta, torch.Tensor, torch.Tensor]:
    """Rows with `ctx` tokens each, the last `q_len` of them new; pages laid out in order.
    `paged`: one-token rows go to the paged decode kernel; `extend`: fresh rows too read
    the pool (ops with a paged prompt kernel), as the model runner groups them."""
    pages = -(-ctx // PAGE)
    kv_pages = torch.arange(rows * pages).view(rows, pages)
    slots = (kv_pages[:, :, None] * PAGE + torch.arange(PAGE)).view(rows, -1)[:, :ctx]
    q_pos = torch.arange(ctx - q_len, ctx).repeat(rows, 1)  # [B, Lq]
    dec = paged and q_len == 1
    fresh = q_len == ctx and not extend and not dec
    pooled = not dec and not fresh
    meta = AttnMeta(out_cache_loc=slots[:, ctx - q_len:].reshape(-1), kv_pages=kv_pages,
                    batch=0 if dec else rows, page_size=PAGE,
                    seq_lens=torch.full((rows,), ctx) if dec else None,
                    decode_pages=kv_pages if dec else None,
                    fresh_lens=(q_len,) * rows if fresh else None,
                    extend_starts=(ctx - q_len,) * rows if pooled else None,
                    extend_lens=(q_len,) * rows if pooled else None)
    return meta, q_pos.reshape(-1), torch.arange(q_len - 1, rows * q_len, q_len)


def compiled_forward(model):
    """The torch ops' forward through `torch.compile` (inductor, static shapes: one compile
    per shape, a minute each here). The loader builds weights under inference mode, which
    dynamo cannot trace, so they are cloned into ordinary tensors first (this model only)."""
    with torch.no_grad():
        for m in model.modules():
            for n, p in list(m.named_parameters(recurse=False)):
                setattr(m, n, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
            for n, b in list(m.named_buffers(recurse=False)):
                m._buffers[n] = b.clone()
    compiled = torch.compile(functools.partial(type(model).forward.__wrapped__, model),
                             dynamic=False)

    def run(*args):
        with torch.no_grad():
            return compiled(*args)
    return run


def measure(model_name: str, dtype: str, kernels: list[str], batches: list[int], ctx: int,
            prompt: int, reps: int, bw: float) -> list[dict]:
    """Each shape is timed with every kernel set right after the other (noise is shared).
    `compile` is the torch ops under torch.compile."""
    loaded = load_model(model_name, dtype, torch.device("cpu"))
    ops = {k: choose_ops("torch" if k == "compile" else k, torch.device("cpu"))
           for k in kernels}
    model, cfg = loaded.model, loaded.hf_config
    forward = {k: compiled_forward(model) if k == "compile" else model for k in kernels}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads,
                      model.model.layers[0].self_attn.head_dim, loaded.dtype, PAGE)
    need = max(max(batches) * -(-ctx // PAGE), -(-prompt // PAGE))
    pool = KVPool(layout, need + 1, torch.device("cpu"))
    rows = []
    for b in batches:
        ids = torch.randint(100, 1000, (b,))
        for k, choice in ops.items():
            model.ops = choice.ops
            meta, pos, last = meta_for(b, 1, ctx, model.paged_decode(), model.paged_extend())
            fwd = forward[k]
            step = best_of(lambda: fwd(ids, pos, meta, pool, last), reps)  # noqa: B023
            rows.append({"dtype": dtype, "kernels": k, "phase": "decode", "batch": b,
                         "ctx": ctx, "ms": 1e3 * step, "tok_s": b / step,
                         "weight_gbs": weight_bytes / 1e9 / step,
                         "of_memcpy": weight_bytes / (1 << 30) / step / bw})
    ids = torch.randint(100, 1000, (prompt,))
    for k, choice in ops.items():
        model.ops = choice.ops
        meta, pos, last = meta_for(1, prompt, prompt, extend=model.paged_extend())
        fwd = forward[k]
        t = best_of(lambda: fwd(ids, pos, meta, pool, last[-1:]),  # noqa: B023
                    max(2, reps // 5))
        rows.append({"dtype": dtype, "kernels": k, "phase": "prefill", "batch": 1,
                     "ctx": prompt, "ms": 1e3 * t, "tok_s": prompt / t})
    return rows


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kernels", default="torch,native",
                   help="decoder ops to compare (pdserve/models/ops.py): torch, native, "
                        "compile (torch ops under torch.compile; ~1 min compile per shape)")
    p.add_argument("--ctx", type=int, default=320, help="context tokens of each decode row")
    p.add_argument("--prompt", type=int, default=1024, help="prefill prompt tokens")
    args = p.parse_args()
    batches = [1, 16] if args.quick else [1, 4, 16, 64]
    reps = 5 if args.quick else 20
    bw = memcpy_read_gbs()
    rows = []
    for dtype in args.dtypes.split(","):
        rows += measure(args.model, dtype, args.kernels.split(","), batches, args.ctx,
                        args.prompt, reps, bw)
    print(f"memcpy read bandwidth: {bw:.1f} GiB/s   threads: {torch.get_num_threads()}")
    print_table(rows, ["dtype", "kernels", "phase", "batch", "ctx", "ms", "tok_s", "weight_gbs",
                       "of_memcpy"])
    summary = {"memcpy_gibs": bw}
    for r in rows:
        key = f"{r['dtype']}_{r['kernels']}"
        summary[f"{key}_{r['phase']}_b{r['batch']}_ms"] = r["ms"]
        if r["phase"] == "decode" and r["batch"] == 1:
            summary[f"{key}_decode_b1_of_memcpy"] = r["of_memcpy"]
        if r["phase"] == "prefill":
            summary[f"{key}_prefill_tok_s"] = r["tok_s"]
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
