"""A hand-made profile whose costs are round numbers, so latencies can be checked by hand."""

from __future__ import annotations

from pdserve.plan.profile_model import Profile


def round_profile(**over) -> Profile:
    """Extend step: 10 ms + 1 ms per token; decode step: 20 ms; transfer: 5 ms flat."""
    kw = dict(model="tiny-llama", page_size=16,
              engine={"chunked_prefill_size": 2048, "max_prefill_tokens": 4096,
                      "max_running_requests": 64, "decode_reserve_tokens": 64,
                      "kv_cache_mb": 512, "page_size": 16, "model": "tiny-llama"},
              kv_bytes_per_token=0, kv_pool_tokens=1 << 16, torch_threads=1, cpu_count=2,
              transfer_backend="tcp", prefill_coef=[0.010, 0.001, 0.0],
              decode_coef=[0.020, 0.0, 0.0], transfer_latency_s=0.005, transfer_gbps=1.0)
    kw.update(over)
    return Profile(**kw)
