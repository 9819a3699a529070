"""A batch-invariant linear in Triton: the GEMM of CUDA nodes under
`--enable-deterministic-inference` (pdserve/models/batch_invariant.py).

out[M, N] = x[M, K] @ w[N, K]^T (+ b[N]). Why the bits of a row never depend on M or on the
other rows: every output tile is BLOCK_M x BLOCK_N, fixed per process (no autotuning on the
shape, which is what makes cuBLAS / oneDNN pick another algorithm for another M); each tile's
K reduction runs in BLOCK_K steps from k = 0 upwards into one float32 accumulator, with no
split-K; and a row's products inside a `tl.dot` do not read the tile's other rows. Where a
row sits inside its M tile, or which program computes the tile, changes nothing.

Persistent: the grid is at most one program per SM; program p computes tiles p, p + grid,
... in a fixed order (N tiles of one M tile next to each other, so they share x in cache).
Under Triton's interpreter (`TRITON_INTERPRET=1`, how CI runs it) the dots run in float32
(its bf16 dot is not exact), with wider blocks because a program costs more than a block;
its float32 -> bf16 cast truncates where a GPU rounds to nearest (one ulp at most).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_attention import _LAUNCH, INTERPRETED

BLOCK_M, BLOCK_N, BLOCK_K = (64, 2048, 64) if INTERPRETED else (64, 64, 64)


@triton.jit
def _persistent_matmul(X, W, B, OUT, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in range(pid, tiles, programs):
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        mmask = rm < M
        nmask = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
            kmask = rk < K
            x = tl.load(X + rm[:, None] * stride_xm + rk[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(W + rn[:, None] * stride_wn + rk[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                              input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + rm[:, None] * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


_SMS: dict[int, int] = {}


def _programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":
        return min(tiles, 8)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return min(tiles, _SMS[index])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K], w [N, K], b [N] or None -> [M, N] in x's dtype, batch-invariant per row."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    with _LAUNCH:
        _persistent_matmul[(_programs(x.device, tiles),)](
            x, w, b if b is not None else w, out, m, n, k, x.stride(0), w.stride(0),
            out.stride(0), HAS_BIAS=b is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, DOT_FP32=INTERPRETED or x.dtype == torch.float32)
    return out
