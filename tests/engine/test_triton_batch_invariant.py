"""`--enable-deterministic-inference` with the Triton backend (the CUDA path), run in Triton's
CPU interpreter: the Triton GEMM (pdserve/kernels/triton_matmul.py) gives a row the same
bits in any batch, the Triton extend kernel gives a token the same bits however its prompt
is chunked and whatever rows share its launch, and an engine on them serves a request the
same tokens and logprob bits alone, in a batch and in another chunk size."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import discard_llm, get_llm, pool_problems
from test_batch_invariant import PARAMS, PROMPTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from test_triton_attention import Pool  # noqa: E402  (tests/kernels: the scattered pool)

from pdserve.kernels import triton_attention as ta
from pdserve.kernels import triton_matmul as tm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_triton_gemm_rows_are_the_same_bits_in_any_batch(dtype, bias):
    torch.manual_seed(0)
    # K and N not multiples of the blocks: masked tails on both
    w = torch.randn(300, 200).to(dtype)
    b = torch.randn(300).to(dtype) if bias else None
    x = torch.randn(150, 200).to(dtype)
    full = tm.linear(x, w, b)
    assert full.dtype == dtype and full.shape == (150, 300)
    for m, off in [(1, 0), (1, 70), (3, 5), (tm.BLOCK_M, 1), (tm.BLOCK_M + 1, 9), (90, 60)]:
        assert torch.equal(tm.linear(x[off:off + m], w, b), full[off:off + m]), (m, off)
    # a non-contiguous input (a column slice of a wider tensor) reads the same
    wide = torch.cat([x, x], dim=1)[:, :200]
    assert torch.equal(tm.linear(wide, w, b), full)
    assert tm.linear(x[:0], w, b).shape == (0, 300)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.float32:
        torch.testing.assert_close(full.double(), ref, atol=1e-4, rtol=1e-5)
    else:  # within one bf16 ulp (the interpreter truncates where a GPU rounds)
        ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
        assert bool(((full.double() - ref).abs() <= ulp + 1e-6).all())


def test_triton_extend_tokens_are_position_only():
    """A 45-token prompt whole, in chunks of 7 (each over the pool), and its last token as a
    one-token row beside other rows: the same bits for each token."""
    h, hkv, d, ps, n = 6, 2, 64, 4, 45
    pool = Pool(hkv, d, ps, 64, torch.bfloat16, seed=3)
    table = pool.pages([n, 30])
    q = torch.randn(n, h, d).bfloat16()
    whole = ta.extend_attention(q, pool.k, pool.v, table[:1], ta.ExtendRows((0,), (n,), "cpu"),
                                ps, 0.125, block=16)
    parts, start = [], 0
    while start < n:
        c = min(7, n - start)
        rows = ta.ExtendRows((start,), (c,), "cpu")
        parts.append(ta.extend_attention(q[start:start + c], pool.k, pool.v, table[:1], rows,
                                         ps, 0.125, block=16))
        start += c
    assert torch.equal(torch.cat(parts), whole)
    other = torch.randn(20, h, d).bfloat16()
    rows = ta.ExtendRows((10, n - 1), (20, 1), "cpu")
    two = ta.extend_attention(torch.cat([other, q[n - 1:]]), pool.k, pool.v,
                              torch.stack([table[1], table[0]]), rows, ps, 0.125, block=16)
    assert torch.equal(two[20:], whole[n - 1:])


def test_engine_on_triton_with_the_flag_ignores_batch_and_chunk():
    """tiny-llama in bf16 on the Triton kernels (attention and GEMMs): 2 prompts alone vs
    inside a batch of 4 (19-57 tokens), chunk 16 vs none; the pools come back full."""
    prompts = [p[:n] for p, n in zip(PROMPTS, (23, 41, 57, 19), strict=False)]
    params = dataclasses.replace(PARAMS, max_new_tokens=4)
    results = []
    for chunk in (16, 0):
        llm = get_llm("tiny-llama", dtype="bfloat16", attention_backend="triton",
                      chunked_prefill_size=chunk, enable_deterministic_inference=True,
                      disable_prefix_cache=True)
        info = llm.engine.describe()
        assert info["attention_backend"] == "triton" and info["deterministic_inference"]
        alone = [llm.generate(p, params)[0] for p in prompts[:2]]
        together = llm.generate(prompts, params)
        results.append([(o.output_ids, o.logprobs) for o in together])
        assert [(o.output_ids, o.logprobs) for o in alone] == results[-1][:2], chunk
        assert not pool_problems(llm)
        discard_llm(llm)
    assert results[0] == results[1], "chunk 16 vs unchunked"
