"""KV pool sized from the GPU (--mem-fraction-static, default 0.85): a default node takes
about that share of the card and serves; an explicit --kv-cache-mb wins."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import pool_problems

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)


def test_default_node_fills_the_fraction_and_serves():
    free0, total = torch.cuda.mem_get_info()
    llm = LLM("tiny-llama", device="cuda", cuda_graph_max_bs=0)
    try:
        free, _ = torch.cuda.mem_get_info()
        used_share = 1 - free / total
        assert used_share >= 0.80, (used_share, free0, total)
        assert llm.engine.describe()["kv_pool_reason"].startswith("--mem-fraction-static 0.85")
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                          ignore_eos=True))
        assert len(out[0].output_ids) == 8
        assert not pool_problems(llm)
    finally:
        llm.close()
    torch.cuda.empty_cache()


def test_explicit_kv_cache_mb_wins():
    llm = LLM("tiny-llama", device="cuda", kv_cache_mb=64, cuda_graph_max_bs=0)
    try:
        assert llm.engine.describe()["kv_pool_reason"] == "--kv-cache-mb"
        assert llm.engine.kv_pool.num_pages * llm.engine.layout.bytes_per_token * 16 <= 64 << 20
    finally:
        llm.close()
