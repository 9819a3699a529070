"""`--enable-deterministic-inference` on CUDA (on CPU the same kernels run in the
interpreter: tests/engine/test_triton_batch_invariant.py): the compiled Triton GEMM gives a
row the same bits whatever M, where cuBLAS does not promise it; an engine in bf16 serves a
request the same tokens and logprob bits alone and inside a batch, chunked or not."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import pool_problems

from pdserve import LLM, SamplingParams
from pdserve.kernels import triton_matmul as tm

pytestmark = pytest.mark.timeout(600)


def test_triton_gemm_on_cuda_is_row_invariant_and_close_to_cublas():
    torch.manual_seed(0)
    w = torch.randn(4096, 2048, device="cuda").bfloat16()
    b = torch.randn(4096, device="cuda").bfloat16()
    x = torch.randn(700, 2048, device="cuda").bfloat16()
    full = tm.linear(x, w, b)
    for m, off in [(1, 0), (1, 333), (7, 5), (64, 1), (65, 100), (513, 150)]:
        assert torch.equal(tm.linear(x[off:off + m], w, b), full[off:off + m]), (m, off)
    torch.testing.assert_close(full.float(), F.linear(x, w, b).float(), atol=0.25, rtol=0.02)


def test_engine_bf16_on_cuda_ignores_batch_and_chunk():
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(17, 400))]
               for _ in range(12)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = []
    for chunk in (64, 0):
        llm = LLM("synthetic-1b", device="cuda", dtype="bfloat16", chunked_prefill_size=chunk,
                  enable_deterministic_inference=True, disable_prefix_cache=True,
                  max_total_tokens=16384)
        try:
            assert llm.engine.describe()["attention_backend"] == "triton"
            alone = [llm.generate(p, params)[0] for p in prompts[:3]]
            together = llm.generate(prompts, params)
            runs.append([(o.output_ids, o.logprobs) for o in together])
            assert [(o.output_ids, o.logprobs) for o in alone] == runs[-1][:3], chunk
            assert not pool_problems(llm)
        finally:
            llm.close()
    assert runs[0] == runs[1]
