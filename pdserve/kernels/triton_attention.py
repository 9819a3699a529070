"""Paged attention in Triton: the attention of CUDA nodes, read from the KV pool in place.

Two kernels, both over the pool layout of pdserve/memory/kv_pool.py (per layer, K and V
buffers of [slots, Hkv, D]; slot = page * page_size + offset, pages named per request by a
[B, P] page table):

- `decode_attention`: one new token per row over its whole context, flash-decoding style.
  Stage 1 splits each row's context into `NUM_SPLITS` equal parts (rounded up to whole
  blocks) and runs one program per (row, query head, split), keeping the running max,
  sum and weighted values of its part; stage 2 merges the parts. The split of a row
  depends only on its own length, never on the batch, and no host value is read, so a
  decode batch can be captured in a CUDA graph.
- `extend_attention`: the new tokens of prompt rows (fresh prompts, later chunks, rows
  with a prefix-cache hit) attend causally over their whole context, prefix and new
  tokens alike, read from the pool: `rope_and_store` wrote the new tokens' K/V there
  before attention runs. One program per (block of a row's queries, row, query head);
  rows are ragged, nothing is padded to the longest row and no context is gathered.

GQA: query head h reads KV head h // (H / Hkv). Scores, softmax and sums are float32. The
dot products of `extend_attention` run in float32 where the inputs are float32 or the
kernels run in Triton's CPU interpreter (`TRITON_INTERPRET=1`, which is how the tests run
them: its bf16 dot is not exact), else in the inputs' dtype with float32 accumulation.
SGLang's triton attention backend (decode_attention.py, extend_attention.py) is the
design these follow.

Shapes: B rows, H / Hkv query / KV heads, D head dim, T new tokens of the prompt rows.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Block and split sizes. In the interpreter a program costs far more than a wider block
# (numpy vectorises the block), so it runs fewer, larger ones; the kernel tests pass small
# sizes explicitly to cross block and split boundaries.
DECODE_SPLITS, DECODE_BLOCK = (2, 64) if INTERPRETED else (8, 32)
# The interpreter keeps the running grid in module globals: two engines' forward threads in
# one process (the in-process PD tests) launching at once read each other's program ids. A
# compiled launch is thread-safe and takes no lock.
_LAUNCH = threading.Lock() if INTERPRETED else contextlib.nullcontext()


def available(device: torch.device) -> str | None:
    """None when the kernels can run on `device`, else why not."""
    if device.type == "cuda":
        return None
    if INTERPRETED:
        return None
    return (f"Triton runs on {device.type} only in its interpreter (TRITON_INTERPRET=1, "
            "for tests)")


# Reductions through `tl.reduce` with the standard combine functions: what `tl.sum` and
# `tl.max` run for float32, minus a device-function call, which in the interpreter costs a
# re-patch of triton.language (~3 ms) each time.
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def _decode_split(Q, K, V, PAGES, SEQ_LENS, ACC, MAX, SUM, scale, page_size,
                  stride_qb, stride_qh, stride_kt, stride_kh, stride_pb,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2).to(tl.int64)
    kvh = h // G
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    split_len = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        pmask = pos < end
        page = tl.load(PAGES + b * stride_pb + pos // page_size, mask=pmask,
                       other=0).to(tl.int64)
        slot = page * page_size + pos % page_size
        kv_off = slot[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(K + kv_off, mask=kvmask, other=0.0).to(tl.float32)
        score = tl.reduce(k * q[None, :], 1, _ADD) * scale
        score = tl.where(pmask, score, -float("inf"))
        m_new = tl.maximum(m_i, tl.reduce(score, 0, _MAX))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(score - m_new)
        v = tl.load(V + kv_off, mask=kvmask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.reduce(p[:, None] * v, 0, _ADD)
        l_i = l_i * alpha + tl.reduce(p, 0, _ADD)
        m_i = m_new
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + s
    tl.store(ACC + part * BLOCK_D + d, acc)
    tl.store(MAX + part, m_i)
    tl.store(SUM + part, l_i)


@triton.jit
def _decode_merge(ACC, MAX, SUM, OUT, stride_ob, stride_oh,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    base = (b * tl.num_programs(1) + h) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    m = tl.load(MAX + base + s)  # an empty split holds -inf and a sum of 0: weight 0
    w = tl.exp(m - tl.reduce(m, 0, _MAX))
    total = tl.reduce(w * tl.load(SUM + base + s), 0, _ADD)
    acc = tl.load(ACC + (base + s)[:, None] * BLOCK_D + d[None, :])
    out = tl.reduce(acc * w[:, None], 0, _ADD) / total
    tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty),
             mask=d < D)


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_pages: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                     scale: float, num_splits: int = DECODE_SPLITS,
                     block_n: int = DECODE_BLOCK) -> torch.Tensor:
    """q [B, H, D] (last dim contiguous), k_buf / v_buf [slots, Hkv, D], kv_pages [B, P],
    seq_lens [B] (context incl. the new token, >= 1) -> [B, H, D] in q's dtype."""
    b, h, d = q.shape
    hkv = k_buf.shape[1]
    block_d = max(16, triton.next_power_of_2(d))
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    acc = torch.empty((b, h, num_splits, block_d), dtype=torch.float32, device=q.device)
    mx = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    sm = torch.empty_like(mx)
    with _LAUNCH:
        _decode_split[(b, h, num_splits)](
            q, k_buf, v_buf, kv_pages, seq_lens, acc, mx, sm, scale, page_size,
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), kv_pages.stride(0),
            G=h // hkv, D=d, BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits)
        _decode_merge[(b, h)](acc, mx, sm, out, out.stride(0), out.stride(1), D=d,
                              BLOCK_D=block_d, NUM_SPLITS=num_splits)
    return out


@triton.jit
def _extend(Q, K, V, OUT, PAGES, Q_START, PREFIX, Q_LEN, scale, page_size,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_pb, stride_ot, stride_oh,
            G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    mblk = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    q_len = tl.load(Q_LEN + r).to(tl.int64)
    if mblk * BLOCK_M >= q_len:
        return
    kvh = h // G
    prefix = tl.load(PREFIX + r).to(tl.int64)
    q0 = tl.load(Q_START + r).to(tl.int64)
    m_idx = mblk * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    mmask = m_idx < q_len
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dmask = d < D
    q_off = (q0 + m_idx)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(Q + q_off, mask=mmask[:, None] & dmask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = prefix + m_idx  # absolute position of each query
    kv_end = prefix + tl.minimum((mblk + 1) * BLOCK_M, q_len)  # past the block's last query
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The same page walk as _decode_split's, written out again: a shared @triton.jit helper
    # would cost a re-patch per call in the interpreter (see _ADD above).
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        pmask = pos < kv_end
        page = tl.load(PAGES + r * stride_pb + pos // page_size, mask=pmask,
                       other=0).to(tl.int64)
        slot = page * page_size + pos % page_size
        kv_off = slot[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(K + kv_off, mask=kvmask, other=0.0)
        v = tl.load(V + kv_off, mask=kvmask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            score = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            score = tl.dot(q, tl.trans(k)) * scale
        # Causal; every query sees key 0, so no row of a block is all -inf.
        ok = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
        score = tl.where(ok, score, -float("inf"))
        m_new = tl.maximum(m_i, tl.reduce(score, 1, _MAX))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(score - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _ADD)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    o_off = (q0 + m_idx)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(OUT + o_off, out.to(OUT.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


class ExtendRows:
    """Device copies of a batch's ragged prompt rows, built once per forward and reused by
    every layer: where each row's tokens start in q, its cached prefix and its new tokens."""

    def __init__(self, starts: tuple[int, ...], lens: tuple[int, ...],
                 device: torch.device) -> None:
        self.key = (starts, lens)
        offsets = [0]
        for n in lens[:-1]:
            offsets.append(offsets[-1] + n)
        # one int32 tensor, one host->device copy: [q offsets; prefixes; lengths]
        table = torch.tensor([offsets, list(starts), list(lens)], dtype=torch.int32)
        self.table = table.to(device, non_blocking=True)
        self.max_len = max(lens, default=0)
        self.rows = len(lens)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_pages: torch.Tensor, rows: ExtendRows, page_size: int,
                     scale: float, block: int | None = None) -> torch.Tensor:
    """q [T, H, D] (the rows' new tokens, consecutive; last dim contiguous), k_buf / v_buf
    [slots, Hkv, D] already holding the new tokens, kv_pages [B, P] -> [T, H*D]. `block`:
    queries and keys per step (a power of two >= 16)."""
    t, h, d = q.shape
    hkv = k_buf.shape[1]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out.view(t, h * d)
    block_d = max(16, triton.next_power_of_2(d))
    if block is None:
        block = 64 if INTERPRETED or block_d <= 64 else 32
    grid = (triton.cdiv(rows.max_len, block), rows.rows, h)
    table = rows.table
    with _LAUNCH:
        _extend[grid](q, k_buf, v_buf, out, kv_pages, table[0], table[1], table[2], scale,
                      page_size, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
                      kv_pages.stride(0), out.stride(0), out.stride(1), G=h // hkv, D=d,
                      BLOCK_D=block_d, BLOCK_M=block, BLOCK_N=block,
                      DOT_FP32=INTERPRETED or q.dtype == torch.float32)
    return out.view(t, h * d)
