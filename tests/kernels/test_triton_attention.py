"""The Triton paged attention kernels (pdserve/kernels/triton_attention.py), run in Triton's
CPU interpreter, against attention computed in float64 from each row's context gathered out
of the pool: page sizes 1 and 16, GQA ratios 1/3/8, head dims 64 and 128, ragged rows,
prefix hits, chunk boundaries, and a mixed batch served by both kernels in one forward."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.kernels import triton_attention as ta

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class Pool:
    """A KV pool of one layer with each request's pages scattered (not in order)."""

    def __init__(self, hkv: int, d: int, page_size: int, num_pages: int, dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ps = page_size
        self.k = torch.randn(num_pages * page_size, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(num_pages * page_size, hkv, d, generator=g).to(dtype)
        self.free = list(range(1, num_pages))  # page 0 pads the page tables
        random.Random(seed).shuffle(self.free)

    def pages(self, lens: list[int]) -> torch.Tensor:
        width = max(-(-n // self.ps) for n in lens)
        table = torch.zeros(len(lens), width, dtype=torch.int32)
        for i, n in enumerate(lens):
            for j in range(-(-n // self.ps)):
                table[i, j] = self.free.pop()
        return table

    def context(self, table: torch.Tensor, row: int, n: int) -> tuple[torch.Tensor, ...]:
        pos = torch.arange(n)
        slots = table[row, pos // self.ps].long() * self.ps + pos % self.ps
        return self.k[slots].double(), self.v[slots].double()  # [n, Hkv, D]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
              scale: float) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.. over keys [L, Hkv, D], causal, float64."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    qpos = first_pos + torch.arange(q.shape[0])
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


SHAPES = [(4, 4, 64), (6, 2, 64), (8, 1, 128)]  # (H, Hkv, D): GQA ratios 1, 3, 8


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("h", "hkv", "d"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(page_size, h, hkv, d, dtype):
    lens = [1, 37, 130]  # one token, a page boundary crossed, several splits
    pool = Pool(hkv, d, page_size, 400 // page_size + 4, dtype, seed=h * d + page_size)
    table = pool.pages(lens)
    q = torch.randn(len(lens), h, d).to(dtype)
    scale = d ** -0.5
    out = ta.decode_attention(q, pool.k, pool.v, table, torch.tensor(lens, dtype=torch.int32),
                              page_size, scale, num_splits=4, block_n=16)
    assert out.shape == q.shape and out.dtype == dtype
    for i, n in enumerate(lens):
        k, v = pool.context(table, i, n)
        want = reference(q[i:i + 1], k, v, n - 1, scale)[0]
        torch.testing.assert_close(out[i].double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_reads_a_strided_query_and_ignores_the_batch():
    """q as the model passes it (a view into qkv); a row's result does not depend on what
    else is in the batch (its splits depend on its own length only)."""
    h, hkv, d, ps = 4, 2, 64, 16
    pool = Pool(hkv, d, ps, 40, torch.float32, seed=5)
    lens = [200, 19, 64]
    table = pool.pages(lens)
    qkv = torch.randn(3, h + 2 * hkv, d)
    q = qkv[:, :h]
    seq = torch.tensor(lens, dtype=torch.int32)
    alone = [ta.decode_attention(q[i:i + 1], pool.k, pool.v, table[i:i + 1], seq[i:i + 1],
                                 ps, 0.125, num_splits=4, block_n=16) for i in range(3)]
    together = ta.decode_attention(q, pool.k, pool.v, table, seq, ps, 0.125, num_splits=4,
                                   block_n=16)
    for i in range(3):
        assert torch.equal(together[i], alone[i][0])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("h", "hkv", "d"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_matches_reference(page_size, h, hkv, d, dtype):
    # (cached prefix, new tokens): a fresh prompt, a prefix hit, a chunk ending on a page
    # boundary, a one-token row (a decode row served as a ragged extend row)
    rows = [(0, 21), (16, 9), (32, 16), (40, 1)]
    totals = [p + n for p, n in rows]
    pool = Pool(hkv, d, page_size, 200 // page_size + 8, dtype, seed=h + d + page_size)
    table = pool.pages(totals)
    t = sum(n for _, n in rows)
    q = torch.randn(t, h, d).to(dtype)
    scale = d ** -0.5
    er = ta.ExtendRows(tuple(p for p, _ in rows), tuple(n for _, n in rows), q.device)
    out = ta.extend_attention(q, pool.k, pool.v, table, er, page_size, scale, block=16)
    assert out.shape == (t, h * d) and out.dtype == dtype
    check_extend(out, q, pool, table, rows, scale)


def check_extend(out: torch.Tensor, q: torch.Tensor, pool: Pool, table: torch.Tensor,
                 rows: list[tuple[int, int]], scale: float) -> None:
    """`out` [T, H*D] of extend rows (cached prefix, new tokens) against the reference."""
    h, d = q.shape[1:]
    tol = TOL[q.dtype]
    start = 0
    for i, (p, n) in enumerate(rows):
        k, v = pool.context(table, i, p + n)
        want = reference(q[start:start + n], k, v, p, scale).reshape(n, h * d)
        torch.testing.assert_close(out[start:start + n].double().cpu(), want, atol=tol,
                                   rtol=tol)
        start += n


def test_chunked_prompt_equals_the_whole_prompt():
    """A prompt attended in two chunks (the second reading the first from the pool) gives
    the rows the whole prompt gives."""
    h, hkv, d, ps = 4, 2, 64, 16
    pool = Pool(hkv, d, ps, 16, torch.float32, seed=9)
    table = pool.pages([50])
    q = torch.randn(50, h, d)
    whole = ta.extend_attention(q, pool.k, pool.v, table, ta.ExtendRows((0,), (50,), q.device),
                                ps, 0.125, block=16)
    first = ta.extend_attention(q[:32], pool.k, pool.v, table,
                                ta.ExtendRows((0,), (32,), q.device), ps, 0.125, block=16)
    second = ta.extend_attention(q[32:], pool.k, pool.v, table,
                                 ta.ExtendRows((32,), (18,), q.device), ps, 0.125)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)


def test_interpreter_dot_gives_a_row_the_same_bits_at_any_tile_position():
    """Under the interpreter `tl.dot` is numpy.matmul: a row must come out the same bits
    wherever it sits in the tile, or the kernels' batch-invariance tests would blame the
    kernels for numpy's BLAS (tests/conftest.py picks an OpenBLAS kernel that holds)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for m, k, n in [(64, 64, 2048), (16, 64, 16), (64, 200, 300)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        full = a @ b
        for i in range(m):
            alone = np.zeros_like(a)
            alone[0] = a[i]
            assert np.array_equal((alone @ b)[0], full[i]), (m, k, n, i)
