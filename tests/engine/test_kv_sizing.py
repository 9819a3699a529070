"""KV pool sizing (pdserve/engine/kv_sizing.py): explicit sizes win, CPU nodes get 512 MiB,
CUDA nodes get what --mem-fraction-static leaves after the weights and the measured
activation peak; the probe runs a real forward of the largest prompt batch."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import get_llm, greedy

from pdserve.config import EngineConfig
from pdserve.engine.kv_sizing import (
    CPU_DEFAULT_KV_MB,
    kv_pool_size,
    pool_bytes_from_fraction,
    probe_activation_peak,
)
from pdserve.memory.kv_pool import KVLayout

GIB = 1 << 30
LAYOUT = KVLayout(32, 8, 128, torch.bfloat16, 16)  # Llama-3-8B: 128 KiB a token
PAGE = LAYOUT.bytes_per_token * 16


def test_fraction_rule():
    # 141 GiB card, 16 GiB of weights, 0.85: the pool gets 0.85 x 141 - 16 - peak.
    got = pool_bytes_from_fraction(141 * GIB, 125 * GIB, 16 * GIB, 3 * GIB, 0.85)
    assert got == int(141 * GIB * 0.85) - 16 * GIB - 3 * GIB
    # Sharing the card: a second node's share is capped by what is free.
    assert pool_bytes_from_fraction(141 * GIB, 40 * GIB, 2 * GIB, GIB, 0.425) == 39 * GIB
    with pytest.raises(ValueError, match="no memory left for the KV pool"):
        pool_bytes_from_fraction(141 * GIB, 125 * GIB, 16 * GIB, 3 * GIB, 0.1)


def test_explicit_sizes_win_and_cpu_default():
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")

    def never() -> int:
        raise AssertionError("probed although the size was given")

    size = kv_pool_size(EngineConfig(max_total_tokens=4096, kv_cache_mb=64), LAYOUT, cuda, never)
    assert size.pages == 256 and size.reason == "--max-total-tokens"
    size = kv_pool_size(EngineConfig(kv_cache_mb=64), LAYOUT, cuda, never)
    assert size.pages == (64 << 20) // PAGE and size.reason == "--kv-cache-mb"
    size = kv_pool_size(EngineConfig(), LAYOUT, cpu, never)
    assert size.pages == (CPU_DEFAULT_KV_MB << 20) // PAGE and "cpu" in size.reason


def test_cuda_default_sizes_from_the_fraction(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (125 * GIB, 141 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 16 * GIB)
    size = kv_pool_size(EngineConfig(mem_fraction_static=0.9), LAYOUT, torch.device("cuda:0"),
                        lambda: 2 * GIB)
    want = int(141 * GIB * 0.9) - 16 * GIB - 2 * GIB
    assert size.pages == want // PAGE
    assert "--mem-fraction-static 0.9" in size.reason and "activation peak 2.00" in size.reason


def test_bad_fraction_is_refused():
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="mem_fraction_static"):
            EngineConfig(mem_fraction_static=bad)


def test_probe_runs_the_largest_prompt_batch_and_leaves_the_engine_serving():
    llm = get_llm()
    e = llm.engine
    assert e.describe()["kv_pool_reason"] == "--max-total-tokens"  # the tests' engines set it
    seen = []
    model = e.loaded.model
    real = model.forward

    def spy(ids, pos, meta, pool, rows):
        seen.append((ids.shape[0], rows.shape[0], pool.num_pages))
        return real(ids, pos, meta, pool, rows)

    model.forward = spy
    try:
        assert probe_activation_peak(model, e.layout, e.device, 300, 8,
                                     model.paged_extend()) == 0  # no allocator stats on CPU
    finally:
        del model.forward
    assert seen == [(300, 8, 20)]  # 300 tokens in 19 pages of 16, plus page 0
    out = llm.generate([[5, 6, 7]], greedy(3, ignore_eos=True))
    assert len(out[0].output_ids) == 3
