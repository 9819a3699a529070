"""`--enable-deterministic-inference` (pdserve/models/batch_invariant.py): in bfloat16, a
request's tokens and logprob bits do not depend on what else is in its batches or on the
chunk size, and without the flag they do somewhere (the negative control that shows the
mechanism is what makes them equal)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import discard_llm, get_llm

from pdserve import SamplingParams
from pdserve.kernels.isa import cpu_flags
from pdserve.models.batch_invariant import ROWS, BatchInvariantOps, token_attention
from pdserve.models.llama import _gathered_extend
from pdserve.models.ops import TorchOps, choose_ops

SMOLLM = "smollm2-135m"
# SmolLM2 through the batch-invariant ops: ~30 s where the fused bf16 kernels run (CPUs with
# AVX512-BF16), ~5 min on torch's bf16 ops elsewhere (AVX2). There tiny-llama covers the
# mechanism in CI and `scripts/slow_checks.sh` runs SmolLM2.
SMOLLM_HEAVY = (SMOLLM if "avx512_bf16" in cpu_flags()
                else pytest.param(SMOLLM, marks=pytest.mark.slow))


def _ops_under_test() -> list[TorchOps]:
    ops = [TorchOps()]
    native = choose_ops("auto", torch.device("cpu")).ops
    if native.name == "native":
        ops.append(native)
    return ops


@pytest.mark.parametrize("base", _ops_under_test(), ids=lambda o: o.name)
def test_blocked_linear_rows_are_the_same_bits_in_any_batch(base):
    torch.manual_seed(0)
    w = torch.randn(1536, 576).bfloat16()
    b = torch.randn(1536).bfloat16()
    x = torch.randn(300, 576).bfloat16()
    ops = BatchInvariantOps(base, kernel_extend=False)
    full = ops.linear(x, w, b)
    for m, off in [(1, 0), (1, 7), (5, 3), (ROWS, 0), (ROWS + 1, 2), (40, 11), (129, 100)]:
        assert torch.equal(ops.linear(x[off:off + m], w, b), full[off:off + m]), (m, off)
    assert ops.linear(x[:0], w, b).shape == (0, 1536)
    # WIDE-row blocks, where the probe lets a weight take them, give the ROWS-row bits
    assert torch.equal(full, ops._blocked(x, w, b)), ops.wide_ok(w, b)
    # the same products as the plain GEMM, to bf16 rounding of the output
    torch.testing.assert_close(full.float(), F.linear(x, w, b).float(), atol=0.06, rtol=0.02)


def _pool(ctx: int, hkv: int, d: int, page: int):
    torch.manual_seed(1)
    pages = -(-ctx // page)
    k_buf = torch.randn(pages * page + page, hkv, d).bfloat16()
    v_buf = torch.randn(pages * page + page, hkv, d).bfloat16()
    order = torch.randperm(pages + 1)[:pages]  # scattered pages
    return k_buf, v_buf, order.view(1, -1)


def test_token_attention_is_position_only_and_matches_sdpa():
    h, hkv, d, page, ctx = 6, 2, 32, 4, 37
    k_buf, v_buf, table = _pool(ctx, hkv, d, page)
    q = torch.randn(ctx, h, d).bfloat16()
    whole = token_attention(q, k_buf, v_buf, table, (0,), (ctx,), page, 0.2)
    ref = _gathered_extend(q.float(), k_buf.float(), v_buf.float(), table, (0,), (ctx,),
                           page, 0.2)
    torch.testing.assert_close(whole.float(), ref, atol=0.02, rtol=0.02)
    # the same tokens in chunks of 5 (a chunked prompt), and the last one as a decode row
    parts, start = [], 0
    while start < ctx:
        n = min(5, ctx - start)
        parts.append(token_attention(q[start:start + n], k_buf, v_buf, table, (start,), (n,),
                                     page, 0.2))
        start += n
    assert torch.equal(torch.cat(parts), whole)
    two = token_attention(torch.cat([q[ctx - 1:], q[:3]]), k_buf, v_buf, table.repeat(2, 1),
                          (ctx - 1, 0), (1, 3), page, 0.2)
    assert torch.equal(two[:1], whole[ctx - 1:]) and torch.equal(two[1:], whole[:3])


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(17, 200))]
            for _ in range(n)]


PROMPTS = _prompts(10, 7)
PARAMS = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, logprobs=0)


def _runs(model: str, deterministic: bool, chunk: int) -> tuple[list, list]:
    """(each of the first 3 prompts alone, all 10 prompts together) as (tokens, logprobs)."""
    llm = get_llm(model, dtype="bfloat16", chunked_prefill_size=chunk,
                  enable_deterministic_inference=deterministic, disable_prefix_cache=True)
    try:
        alone = [llm.generate(p, PARAMS)[0] for p in PROMPTS[:3]]
        together = llm.generate(PROMPTS, PARAMS)
    finally:
        if not deterministic:
            discard_llm(llm)  # only the negative control: not needed again
    return ([(o.output_ids, o.logprobs) for o in alone],
            [(o.output_ids, o.logprobs) for o in together])


@pytest.mark.parametrize("model", ["tiny-llama", SMOLLM_HEAVY])
def test_deterministic_tokens_and_logprobs_ignore_batch_and_chunk(model):
    alone64, together64 = _runs(model, True, 64)
    alone0, together0 = _runs(model, True, 0)
    assert alone64 == together64[:3], "a prompt alone vs inside a batch of 10 (chunk 64)"
    assert alone0 == together0[:3], "a prompt alone vs inside a batch of 10 (unchunked)"
    assert together64 == together0, "chunked at 64 vs unchunked"
    # inside a batch of 32 mixed lengths, chunked at 128
    llm = get_llm(model, dtype="bfloat16", chunked_prefill_size=128,
                  enable_deterministic_inference=True, disable_prefix_cache=True)
    crowd = llm.generate(PROMPTS[:3] + _prompts(29, 8), PARAMS)
    assert [(o.output_ids, o.logprobs) for o in crowd[:3]] == alone64, "batch of 32, chunk 128"
    discard_llm(llm)
    llm = get_llm(model, dtype="bfloat16", chunked_prefill_size=64,
                  enable_deterministic_inference=True, disable_prefix_cache=True)
    info = llm.engine.describe()
    assert info["deterministic_inference"] is True
    assert info["attention"]["decode"].startswith("batch-invariant")


def test_without_the_flag_bf16_results_depend_on_the_batch():
    """The negative control: the same comparisons without the flag differ somewhere (the
    logprob bits at least), so the test above proves the mechanism."""
    alone64, together64 = _runs(SMOLLM, False, 64)
    alone0, together0 = _runs(SMOLLM, False, 0)
    assert (alone64 != together64[:3] or alone0 != together0[:3]
            or together64 != together0)


def test_tensor_parallel_with_the_flag_is_refused():
    from pdserve.config import EngineConfig

    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(tp_size=2, enable_deterministic_inference=True)


@pytest.mark.parametrize("model", ["tiny-llama", SMOLLM_HEAVY])
def test_a_cache_hit_and_a_continuation_give_the_same_bits(model):
    """A prompt served from the prefix cache, and prompt + k generated tokens sent again (what
    a router migration does: the k tokens' KV is recomputed as prompt rows) continue with
    the same tokens and logprob bits."""
    llm = get_llm(model, dtype="bfloat16", chunked_prefill_size=64,
                  enable_deterministic_inference=True)
    prompt = PROMPTS[3]
    first = llm.generate(prompt, PARAMS)[0]
    again = llm.generate(prompt, PARAMS)[0]
    assert again.cached_tokens > 0
    assert (again.output_ids, again.logprobs) == (first.output_ids, first.logprobs)
    k = 7
    tail = SamplingParams(max_new_tokens=PARAMS.max_new_tokens - k, temperature=0,
                          ignore_eos=True, logprobs=0)
    rest = llm.generate(prompt + first.output_ids[:k], tail)[0]
    assert rest.output_ids == first.output_ids[k:]
    assert rest.logprobs == first.logprobs[k:]
