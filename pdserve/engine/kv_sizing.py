"""KV pool size from the device's memory (`--mem-fraction-static`, SGLang's name).

`fraction` of the device's total memory is what this node's static state may take:
weights, KV pool and the activations of the largest batch. The weights are loaded first;
then one dummy forward of the largest prompt batch the node admits (`max_prefill_tokens`
new tokens, with logits for `max_running_requests` rows) measures the activation peak; the
pool gets the rest of the share, and never more than is free on the device:

    pool = min(total * fraction - own, free) - activation_peak

`own` is what this process's allocator holds (the weights), `free` the device's free
memory, so nodes sharing one GPU each keep to their own share (`pdserve up` gives each of
its N nodes on a GPU 0.85 / N) and a late starter never takes memory another node holds.
An explicit `--kv-cache-mb` or `--max-total-tokens` wins; CPU nodes, whose memory is the
machine's, default to `CPU_DEFAULT_KV_MB`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.memory.kv_pool import KVLayout, KVPool
from pdserve.models.llama import AttnMeta

CPU_DEFAULT_KV_MB = 512


@dataclass(frozen=True)
class PoolSize:
    pages: int
    reason: str  # for /server_info: where the size came from


def pool_bytes_from_fraction(total: int, free: int, own: int, activation_peak: int,
                             fraction: float) -> int:
    """Bytes the KV pool may take; raises ValueError (with the figures) when none are left."""
    share = int(total * fraction)
    budget = min(share - own, free) - activation_peak
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"--mem-fraction-static {fraction}: no memory left for the KV pool (device "
            f"{total / gib:.1f} GiB, this node's share {share / gib:.1f} GiB, weights "
            f"{own / gib:.1f} GiB, free {free / gib:.1f} GiB, activation peak "
            f"{activation_peak / gib:.2f} GiB); raise --mem-fraction-static, lower "
            "--max-prefill-tokens, or set --kv-cache-mb")
    return budget


def probe_activation_peak(model, layout: KVLayout, device: torch.device, tokens: int,
                          logit_rows: int, extend: bool) -> int:
    """Peak bytes above the current allocation while one fresh prompt of `tokens` tokens
    runs through `model`, keeping logits for `logit_rows` rows: the largest prompt batch
    the node admits (a mixed batch's decode rows add one token each). Uses a scratch pool
    just large enough, freed before returning. 0 where the device keeps no allocator
    statistics (CPU)."""
    ps = layout.page_size
    pages = -(-tokens // ps)
    pool = KVPool(layout, pages + 1, device)  # page 0 stays unused, as in the real pool
    cuda = device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        pos = torch.arange(tokens, device=device)
        meta = AttnMeta(out_cache_loc=pos + ps, kv_pages=torch.arange(
            1, pages + 1, device=device).view(1, -1), batch=1, page_size=ps,
            fresh_lens=None if extend else (tokens,),
            extend_starts=(0,) if extend else None, extend_lens=(tokens,) if extend else None)
        rows = torch.arange(tokens - min(logit_rows, tokens), tokens, device=device)
        with torch.inference_mode():
            logits = model(ids, pos, meta, pool, rows)
            logits.float().softmax(-1)  # the sampler's float32 copy
        if not cuda:
            return 0
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    finally:
        del pool
        if cuda:
            torch.cuda.empty_cache()


def kv_pool_size(cfg, layout: KVLayout, device: torch.device,
                 probe: Callable[[], int]) -> PoolSize:
    """The pool's pages for EngineConfig `cfg`: --max-total-tokens, else --kv-cache-mb,
    else (CUDA, one rank) --mem-fraction-static with `probe()` measuring the activation
    peak, else CPU_DEFAULT_KV_MB."""
    ps = layout.page_size
    page_bytes = layout.bytes_per_token * ps  # one page over every layer's K and V

    def of_bytes(n: int) -> int:
        return max(2, n // page_bytes)

    if cfg.max_total_tokens:
        return PoolSize(max(2, cfg.max_total_tokens // ps), "--max-total-tokens")
    if cfg.kv_cache_mb:
        return PoolSize(of_bytes(cfg.kv_cache_mb << 20), "--kv-cache-mb")
    if device.type != "cuda":
        return PoolSize(of_bytes(CPU_DEFAULT_KV_MB << 20),
                        f"{device.type}: {CPU_DEFAULT_KV_MB} MiB (--kv-cache-mb 0)")
    if cfg.tp_size > 1:  # the probe would need every rank's pool, which comes after this
        return PoolSize(of_bytes(CPU_DEFAULT_KV_MB << 20),
                        f"tensor parallel: {CPU_DEFAULT_KV_MB} MiB per rank; set --kv-cache-mb "
                        "(--mem-fraction-static sizes one-rank nodes)")
    peak = probe()
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    budget = pool_bytes_from_fraction(total, free, own, peak, cfg.mem_fraction_static)
    gib = 1 << 30
    return PoolSize(of_bytes(budget),
                    f"--mem-fraction-static {cfg.mem_fraction_static}: {budget / gib:.1f} GiB "
                    f"of {total / gib:.1f} GiB (weights {own / gib:.1f} GiB, free "
                    f"{free / gib:.1f} GiB, activation peak {peak / gib:.2f} GiB)")
