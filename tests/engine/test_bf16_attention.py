"""The AVX512-BF16 attention kernels: prompt rows (pdserve/kernels/extend_attention.cpp)
against float64 attention and torch's SDPA, the same bits however a prompt is chunked or
batched, clear errors on bad input, and end to end the same greedy tokens whatever the
chunk size and loop; decode rows (decode_bf16.cpp) against float64 attention. On a CPU
without AVX512-BF16 these kernels are not built; the tests of them are then skipped and only
the fallback choice is checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import TINY_PROMPTS, get_llm, greedy, pool_problems, run_ids

from pdserve.kernels.isa import BY_NAME, cpu_flags
from pdserve.models.ops import TorchOps

PS = 16

FLAGS = cpu_flags()
HAS_BF16 = "avx512_bf16" in FLAGS
# The kernel's products run on AMX tiles where the CPU runs the `amx` ISA level's code (the
# build here is -march=native).
HAS_AMX = BY_NAME["amx"].needs <= FLAGS
needs_kernel = pytest.mark.skipif(not HAS_BF16, reason="CPU without AVX512-BF16: no kernel")


def test_kernel_is_built_exactly_where_the_cpu_has_avx512_bf16(native):
    assert native.m.has_extend_attention() == HAS_BF16
    assert native.paged_extend(torch.bfloat16, 9, 3, 64) == HAS_BF16
    assert not native.paged_extend(torch.float32, 9, 3, 64)  # float32 keeps SDPA
    assert not native.paged_extend(torch.bfloat16, 8, 8, 72)  # head_dim not a multiple of 16
    assert not TorchOps().paged_extend(torch.bfloat16, 9, 3, 64)


@needs_kernel
def test_products_run_on_amx_exactly_where_the_cpu_has_it(native):
    assert native.extend_products(64) == ("amx" if HAS_AMX else "avx512_bf16")
    assert native.extend_products(128) == native.extend_products(64)
    assert native.extend_products(80) == "avx512_bf16"  # AMX tiles take 32 dims at a time


def _case(h: int, hkv: int, d: int, rows: list[tuple[int, int]], seed: int = 0):
    """A shuffled pool holding each row's context; q a strided view like the model's."""
    g = torch.Generator().manual_seed(seed)
    pages = max(-(-(s + n) // PS) for s, n in rows)
    total = len(rows) * pages + 3
    k_buf = torch.randn(total * PS, hkv, d, generator=g).bfloat16()
    v_buf = torch.randn(total * PS, hkv, d, generator=g).bfloat16()
    table = torch.randperm(total, generator=g)[: len(rows) * pages].view(len(rows), pages)
    qkv = torch.randn(sum(n for _, n in rows), h + 2 * hkv, d, generator=g).bfloat16()
    return qkv[:, :h], k_buf, v_buf, table


def _context(buf: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    slots = (pages.repeat_interleave(PS) * PS + torch.arange(PS).repeat(len(pages)))[:n]
    return buf[slots]  # [n, Hkv, D]


def _reference(q, k_buf, v_buf, table, rows, scale) -> torch.Tensor:
    """float64 causal attention of each row's new tokens over its context: [T, H*D]."""
    h, d = q.shape[1:]
    g = h // k_buf.shape[1]
    outs, t0 = [], 0
    for b, (start, n) in enumerate(rows):
        k = _context(k_buf, table[b], start + n).double().repeat_interleave(g, 1)
        v = _context(v_buf, table[b], start + n).double().repeat_interleave(g, 1)
        s = torch.einsum("ihd,jhd->hij", q[t0:t0 + n].double(), k) * scale
        visible = torch.arange(start + n).view(1, -1) <= torch.arange(start, start + n).view(-1, 1)
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hij,jhd->ihd", p, v).reshape(n, h * d))
        t0 += n
    return torch.cat(outs)


ROWS = [(0, 1), (5, 33), (100, 70), (0, 200), (16, 16)]  # fresh, chunks, page-aligned


@needs_kernel
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 2, 16), (4, 4, 32), (8, 1, 128),
                                     (6, 2, 96)])
def test_matches_float64_attention_to_bf16_rounding(native, h, hkv, d):
    q, k_buf, v_buf, table = _case(h, hkv, d, ROWS)
    starts, lens = zip(*ROWS, strict=True)
    out = native.extend_attention(q, k_buf, v_buf, table, starts, lens, PS, d**-0.5)
    ref = _reference(q, k_buf, v_buf, table, ROWS, d**-0.5)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    # error: rounding the result to bf16 (2^-9 relative), and the probabilities rounded to
    # bf16 before P.V: |sum_j p_j e_j v_j| <= 2^-9 max|v| (sum_j p_j = 1); float32 noise
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2**-8 + 1.1 * 2**-9 * v_buf.abs().max().item()
    assert (err <= bound).all(), (err - bound).max()


@needs_kernel
def test_agrees_with_sdpa_on_fresh_prompts(native):
    rows = [(0, 300)]
    q, k_buf, v_buf, table = _case(9, 3, 64, rows, seed=3)
    out = native.extend_attention(q, k_buf, v_buf, table, (0,), (300,), PS, 0.125)
    k = _context(k_buf, table[0], 300).transpose(0, 1).unsqueeze(0)
    v = _context(v_buf, table[0], 300).transpose(0, 1).unsqueeze(0)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True,
                                          scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out.float(), sdpa[0].transpose(0, 1).reshape(300, -1).float(),
                               atol=2e-2, rtol=2e-2)


@needs_kernel
def test_same_bits_whatever_the_chunking_and_batching(native):
    """A prompt of 250 tokens in one piece, in three chunks, and batched with other rows:
    every token's output is bit-identical (key blocks start at position 0 whatever the
    chunk; masked keys add an exact 0)."""
    q, k_buf, v_buf, table = _case(9, 3, 64, [(0, 250)], seed=5)
    whole = native.extend_attention(q, k_buf, v_buf, table, (0,), (250,), PS, 0.125)
    cuts = [(0, 64), (64, 77), (141, 109)]
    chunks = torch.cat([
        native.extend_attention(q[s:s + n], k_buf, v_buf, table, (s,), (n,), PS, 0.125)
        for s, n in cuts])
    three = table.expand(3, -1).contiguous()  # the chunks as three rows of one batch
    batched = native.extend_attention(q, k_buf, v_buf, three, *zip(*cuts, strict=True), PS,
                                      0.125)
    assert torch.equal(whole, chunks) and torch.equal(whole, batched)


@needs_kernel
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 1, 32), (8, 2, 128), (6, 2, 96)])
def test_rows_read_in_place_give_the_packed_rows_bits(native, h, hkv, d):
    """Rows of one register group (new tokens x G <= 4, decode rows among them) read the
    pool in place instead of packing it: each token's bits equal the same token inside a
    long prompt row (packed), at ends that cut a key block, a key pair and a page."""
    n = 200
    q, k_buf, v_buf, table = _case(h, hkv, d, [(0, n)], seed=11)
    whole = native.extend_attention(q, k_buf, v_buf, table, (0,), (n,), PS, d**-0.5)
    g = h // hkv
    ends = [1, 2, 17, 63, 64, 65, 128, 199, 200]  # context of each one-token row
    if g <= 2:  # two-token rows are in place too
        ends += [-150]
    starts = tuple(abs(e) - (2 if e < 0 else 1) for e in ends)
    lens = tuple(2 if e < 0 else 1 for e in ends)
    rows_q = torch.cat([q[s:s + n_] for s, n_ in zip(starts, lens, strict=True)])
    tables = table.expand(len(ends), -1).contiguous()
    out = native.extend_attention(rows_q, k_buf, v_buf, tables, starts, lens, PS, d**-0.5)
    want = torch.cat([whole[s:s + n_] for s, n_ in zip(starts, lens, strict=True)])
    assert torch.equal(out, want)


@needs_kernel
@pytest.mark.parametrize("starts,lens,needle", [
    ((0,), (10,), "sum to"),  # q has 20 tokens
    ((0, 0), (20,), "one start"),
    ((60,), (20,), "longer than its page row"),
    ((0,), (0,), "bad start or length"),
])
def test_bad_input_is_a_clear_error(native, starts, lens, needle):
    q, k_buf, v_buf, table = _case(4, 4, 32, [(0, 20)])
    table = table[:, :4]  # 4 pages = 64 tokens of context at most
    with pytest.raises(RuntimeError, match=needle):
        native.extend_attention(q, k_buf, v_buf, table, starts, lens, PS, 0.2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.extend_attention(q.float(), k_buf, v_buf, table, (0,), (20,), PS, 0.2)


@needs_kernel
def test_decode_kernel_matches_float64_attention_to_bf16_rounding(native):
    """One token per row over contexts of 1, 2, 15-17 (the 16-key score blocks), 31 and 300
    (odd: the last value pair half empty), for GQA, MHA, one KV head and 16 heads per KV
    head, head_dim 32-256."""
    lens = [1, 2, 15, 16, 17, 31, 300]
    for h, hkv, d in [(9, 3, 64), (4, 4, 32), (8, 1, 128), (16, 1, 64), (2, 1, 256)]:
        rows = [(n - 1, 1) for n in lens]
        q, k_buf, v_buf, table = _case(h, hkv, d, rows, seed=h + d)
        out = native.decode_attention(q, k_buf, v_buf, table, torch.tensor(lens), PS,
                                      d**-0.5)  # [B, H, D]
        ref = _reference(q, k_buf, v_buf, table, rows, d**-0.5)
        err = (out.reshape(len(lens), h * d).double() - ref).abs()
        bound = ref.abs() * 2**-8 + 1.1 * 2**-9 * v_buf.abs().max().item()
        assert (err <= bound).all(), (h, hkv, d, (err - bound).max())


@needs_kernel
def test_bf16_engine_tokens_do_not_depend_on_chunk_size_or_loop():
    """End to end in bf16: prompts prefilled whole or in 16-token chunks, on the overlap
    and the normal loop, give the same greedy tokens, and the pools come back to full."""
    params = greedy(12, ignore_eos=True)
    prompts = [list(p) * 4 for p in TINY_PROMPTS]  # longer prompts: several chunks each
    runs = {}
    for chunk, loop in [(512, "overlap"), (16, "overlap"), (16, "normal")]:
        llm = get_llm("tiny-llama", dtype="bfloat16", chunked_prefill_size=chunk, loop=loop)
        paths = llm.engine.describe()["attention"]
        assert paths["prompt"] == "paged kernel"
        assert paths["prompt_products"] == "avx512_bf16"  # head_dim 16: AMX takes 32 dims
        runs[(chunk, loop)] = run_ids(llm, prompts, params)
        assert not pool_problems(llm)
    first = runs[(512, "overlap")]
    assert all(r == first for r in runs.values()), runs


@needs_kernel
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 4, 32), (6, 2, 96), (8, 1, 128),
                                     (16, 1, 64)])
def test_decode_kernel_bits_do_not_depend_on_the_batch(native, h, hkv, d):
    """A row decoded alone (one task per KV head) and inside a batch big enough for one task
    per request (all KV heads in one walk over the pages) gives the same bits, for the
    shapes whose P.V sums stay in registers (G=3 C=2, G=1 C=1) and those summed in memory."""
    rows_n = 4 * torch.get_num_threads() + 1  # >= 4 rows per thread: whole-request tasks
    lens = [1 + (37 * i) % 301 for i in range(rows_n)]
    q, k_buf, v_buf, table = _case(h, hkv, d, [(n - 1, 1) for n in lens], seed=d + h)
    scale = d**-0.5
    batch = native.decode_attention(q, k_buf, v_buf, table, torch.tensor(lens), PS, scale)
    for b in (0, 1, rows_n // 2, rows_n - 1):
        alone = native.decode_attention(q[b:b + 1], k_buf, v_buf, table[b:b + 1],
                                        torch.tensor(lens[b:b + 1]), PS, scale)
        assert torch.equal(alone[0], batch[b]), (b, lens[b])
