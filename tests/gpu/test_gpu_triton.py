"""The Triton paged attention kernels compiled for CUDA (on CPU the same kernels run in the
interpreter: tests/kernels/test_triton_attention.py): against float64 attention over each
row's gathered context, bf16 dots included; and the engine's default CUDA backend
(`--attention-backend auto` = triton) token-exact against the torch backend (SDPA over
gathered pages) and transformers, with prompts crossing pages and chunks."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TINY_PROMPTS, pool_problems
from test_triton_attention import TOL, Pool, check_extend, reference

from pdserve import LLM, SamplingParams
from pdserve.kernels import triton_attention as ta

pytestmark = pytest.mark.timeout(600)


def _on_cuda(pool: Pool, table: torch.Tensor):
    return pool.k.cuda(), pool.v.cuda(), table.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "d"), [(8, 8, 64), (32, 8, 64), (16, 2, 128)])
def test_decode_and_extend_on_cuda_match_reference(dtype, h, hkv, d):
    assert not ta.INTERPRETED, "TRITON_INTERPRET is set on a CUDA machine"
    ps, scale = 16, d ** -0.5
    lens = [1, 37, 700, 4100]
    rows = [(0, 300), (16, 9), (640, 60), (4096, 4)]  # extend rows: (cached prefix, new)
    need = sum(-(-n // ps) for n in lens + [p + n for p, n in rows])
    pool = Pool(hkv, d, ps, need + 8, dtype, seed=h + d)
    table = pool.pages(lens)
    k, v, pages = _on_cuda(pool, table)
    q = torch.randn(len(lens), h, d).to(dtype)
    out = ta.decode_attention(q.cuda(), k, v, pages,
                              torch.tensor(lens, dtype=torch.int32, device="cuda"), ps, scale)
    for i, n in enumerate(lens):
        kc, vc = pool.context(table, i, n)
        want = reference(q[i:i + 1], kc, vc, n - 1, scale)[0]
        torch.testing.assert_close(out[i].double().cpu(), want, atol=TOL[dtype],
                                   rtol=TOL[dtype])

    table = pool.pages([p + n for p, n in rows])
    k, v, pages = _on_cuda(pool, table)
    q = torch.randn(sum(n for _, n in rows), h, d).to(dtype)
    er = ta.ExtendRows(tuple(p for p, _ in rows), tuple(n for _, n in rows),
                       torch.device("cuda"))
    check_extend(ta.extend_attention(q.cuda(), k, v, pages, er, ps, scale), q, pool, table,
                 rows, scale)


def test_default_cuda_backend_is_triton_and_token_exact_with_torch():
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [list(p) for p in TINY_PROMPTS]
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM("tiny-llama", device="cuda", dtype="float32", attention_backend=backend,
                  chunked_prefill_size=64, max_total_tokens=8192)
        try:
            info = llm.engine.describe()
            assert info["attention_backend"] == ("triton" if backend == "auto" else "torch")
            outs[backend] = [o.output_ids for o in llm.generate(prompts, params)]
            assert not pool_problems(llm)
        finally:
            llm.close()
    assert outs["auto"] == outs["torch"]
