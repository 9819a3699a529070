"""CUDA graphs of decode batches (pdserve/engine/cuda_graphs.py), on CPU: the buckets, which
batches replay, and the padded static forward itself run eagerly (`capture=False`) inside a
real engine: the same greedy tokens as the engine's own forwards, for batches padded up to
their row and page buckets while requests finish at different steps, and the pools back to
full. The captured graphs run in tests/gpu/test_gpu_graphs.py (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, pool_problems, random_prompt, run_ids

from pdserve import LLM
from pdserve.engine.batch import Batch, Row
from pdserve.engine.cuda_graphs import DecodeGraphs, bucket, page_buckets, row_buckets
from pdserve.engine.request import Req
from pdserve.sampling_params import SamplingParams


def test_buckets() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(6) == [1, 2, 4, 6]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert row_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert page_buckets(3) == [3]
    assert page_buckets(256) == [4, 8, 16, 32, 64, 128, 256]
    assert page_buckets(100) == [4, 8, 16, 32, 64, 100]
    assert bucket(5, row_buckets(64)) == 8 and bucket(17, row_buckets(64)) == 24
    assert bucket(65, row_buckets(64)) is None


def _graphs_engine(max_rows: int, max_pages: int, loop: str) -> tuple[LLM, DecodeGraphs]:
    llm = LLM("tiny-llama", max_total_tokens=16384, loop=loop, dtype="float32")
    eng = llm.engine
    graphs = DecodeGraphs(eng.loaded.model, eng.kv_pool, eng.device, max_rows, max_pages,
                          capture=False)
    free = eng.kv_pool.allocator.num_free
    state = graphs.capture_all()
    assert state.enabled and eng.kv_pool.allocator.num_free == free  # borrowed page back
    eng.runner.graphs = graphs
    return llm, graphs


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_padded_static_decode_gives_the_engines_tokens(loop: str) -> None:
    """Five prompts of different lengths and budgets: decode batches of 5, 4, 3, 2, 1 rows
    padded to 8, 4, 4, 2, 1, contexts padded to 4..16 pages; the same tokens as eager."""
    prompts = [random_prompt(9 + 23 * i, seed=700 + i) for i in range(5)]
    params = [greedy(20 + 9 * i, ignore_eos=True) for i in range(5)]
    ref_llm = LLM("tiny-llama", max_total_tokens=16384, loop=loop, dtype="float32")
    try:
        ref = [o.output_ids for o in ref_llm.generate(prompts, params)]
    finally:
        ref_llm.close()
    llm, graphs = _graphs_engine(max_rows=8, max_pages=16, loop=loop)
    try:
        out = [o.output_ids for o in llm.generate(prompts, params)]
        assert out == ref
        assert graphs.state.replays >= 40  # most decode steps went through the padded path
        assert llm.engine.describe()["cuda_graphs"]["replays"] == graphs.state.replays
        assert not pool_problems(llm)
    finally:
        llm.close()


def test_batches_past_the_buckets_run_eagerly() -> None:
    """A context longer than the largest page bucket, or more rows than the largest row
    bucket: eager forwards, still the engine's tokens."""
    llm, graphs = _graphs_engine(max_rows=2, max_pages=4, loop="normal")
    try:
        prompts = [random_prompt(40, seed=800 + i) for i in range(3)]  # 3 rows > 2
        long = [random_prompt(70, seed=900)]  # 70 + 8 tokens > 4 pages of 16
        before = graphs.state.replays
        run_ids(llm, prompts, greedy(8, ignore_eos=True))
        run_ids(llm, long, greedy(8, ignore_eos=True))
        assert graphs.state.replays == before
        assert run_ids(llm, prompts[:1], greedy(8, ignore_eos=True))
        assert graphs.state.replays > before  # one row of 40..48 tokens: bucket (1, 4)
        assert not pool_problems(llm)
    finally:
        llm.close()


def _row(decode: bool, start: int, future_id: int = 1) -> Row:
    req = Req("r", list(range(5)), SamplingParams(max_new_tokens=4), [])
    return Row(req, start, 1, future_id, decode=decode)


def test_only_pure_sampling_decode_batches_replay() -> None:
    graphs = DecodeGraphs(lambda *a: None, _Pool(), torch.device("cpu"), 4, 8, capture=False)
    graphs.state.enabled = True
    assert graphs.key_for(Batch(0, "decode", (_row(True, 20),) * 3)) == (4, 4)
    assert graphs.key_for(Batch(0, "decode", (_row(True, 100),))) == (1, 8)
    assert graphs.key_for(Batch(0, "decode", (_row(True, 128),))) is None  # 129 > 8 pages
    assert graphs.key_for(Batch(0, "decode", (_row(True, 5),) * 5)) is None  # 5 > 4 rows
    assert graphs.key_for(Batch(0, "extend", (_row(False, 0),))) is None  # prompt rows
    assert graphs.key_for(Batch(0, "decode", (_row(True, 5),), load_barrier=3)) is None
    graphs.state.enabled = False
    assert graphs.key_for(Batch(0, "decode", (_row(True, 20),))) is None


class _Pool:
    page_size = 16


def test_only_roles_that_decode_capture_graphs() -> None:
    """A prefill node never runs a decode batch: its engine captures no decode graphs."""
    from decode_node.role import DecodeRole
    from pdserve.engine.role import Role
    from prefill_node.role import PrefillRole

    assert Role.runs_decode and DecodeRole.runs_decode and not PrefillRole.runs_decode
