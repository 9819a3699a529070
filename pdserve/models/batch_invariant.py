"""Batch-invariant ops: a request's result bits depend only on the request, never on what
else is in its batch, how its prompt was chunked, or whether a row is a decode row or a
prompt row (`--enable-deterministic-inference`; docs/serving.md: "Deterministic inference").

Where a batch changes the bits in the normal ops:
- Linears. A GEMM's kernel and its K blocking depend on the number of rows M (oneDNN
  picks another algorithm past ~32 rows on AMX; the native kernels run a one-row bf16 GEMV
  for M = 1; cuBLAS picks split-K and tiles by shape), so the same row gets other rounding
  in another batch. On CPU every product runs in fixed blocks of `ROWS` rows (the last one
  zero-padded): every row of every batch goes through the same GEMM shape, whose per-row
  arithmetic does not depend on the other rows of the block (tests/engine/
  test_batch_invariant.py checks both on the machine). Long inputs take blocks of `WIDE`
  rows for a weight where those give the same bits (checked per weight: `wide_ok`). With
  the Triton backend a Triton GEMM with fixed tiles and no split-K serves
  (pdserve/kernels/triton_matmul.py).
- Attention. Decode rows and prompt rows have different kernels, and SDPA's blocking
  depends on the chunk. Here every row, decode rows included, is a prompt row of one token
  or more over its whole context in the pool (the model runner builds one row group,
  `AttnMeta` without a decode group), served by a kernel whose per-token arithmetic depends
  only on the token's position and context: the native bf16 extend kernel or the Triton
  extend kernel (both walk key blocks from position 0, and a masked key adds an exact 0:
  pdserve/kernels/extend_attention.cpp, triton_attention.py), or elsewhere
  `token_attention`, which computes each token on its own.
- Norms, rope, SiLU and sampling are per row already (per-request generators).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.models.attention_backends import WithAttention
from pdserve.models.llama import _gather_pages
from pdserve.models.ops import TorchOps

ROWS = 16  # rows of every GEMM block: one decode batch of 16 pads nothing
WIDE = 32  # rows of the blocks a long input takes where they give ROWS-row bits
PROBE = 256  # seeded random rows that decide it, per weight


class BatchInvariantOps(WithAttention):
    """The small ops of `base` (the `--kernels` and attention choice) with batch-invariant
    linears and attention (`InvariantAttention`)."""

    batch_invariant = True

    def __init__(self, base: TorchOps, kernel_extend: bool,
                 gemm: Callable[..., torch.Tensor] | None = None) -> None:
        """`gemm(x, w, b)`: a batch-invariant GEMM of any M (the Triton one); None: blocks
        of ROWS rows through `base.linear`."""
        super().__init__(base, InvariantAttention(base, kernel_extend))
        self.gemm = gemm
        self._wide: dict[int, tuple[torch.Tensor, bool]] = {}  # id(w) -> (w, WIDE ok)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> [M, N], through `gemm`, or in blocks of WIDE rows where they give the
        bits of ROWS-row blocks and blocks of exactly ROWS rows for the rest."""
        if self.gemm is not None:
            return self.gemm(x, w, b)
        m = x.shape[0]
        wide = m - m % WIDE if m >= WIDE and self.wide_ok(w, b) else 0
        if wide == 0:
            return self._blocked(x, w, b)
        parts = [self.base.linear(x[i:i + WIDE], w, b) for i in range(0, wide, WIDE)]
        if wide < m:
            parts.append(self._blocked(x[wide:], w, b))
        return torch.cat(parts)

    def wide_ok(self, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        """Whether WIDE-row GEMMs of `w` give every row the bits of ROWS-row ones: where the
        library runs one kernel for both (oneDNN on AMX does for 16 and 32 rows, not for 64).
        Decided once per weight on PROBE seeded random rows: two kernels differ by an ulp in
        about one row in ten, so equal outputs mean one kernel."""
        entry = self._wide.get(id(w))
        if entry is None:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(PROBE, w.shape[1], generator=g).to(w.dtype)
            wide = torch.cat([self.base.linear(x[i:i + WIDE], w, b)
                              for i in range(0, PROBE, WIDE)])
            entry = self._wide[id(w)] = (w, torch.equal(wide, self._blocked(x, w, b)))
        return entry[1]

    def _blocked(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> [M, N] in blocks of exactly ROWS rows (the last one zero-padded)."""
        m = x.shape[0]
        if m == 0:
            return self.base.linear(x, w, b)
        pad = -m % ROWS
        if pad:
            x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        out = torch.cat([self.base.linear(x[i:i + ROWS], w, b)
                         for i in range(0, m + pad, ROWS)])
        return out[:m] if pad else out


class InvariantAttention:
    """Every row is a prompt row over the pool. `kernel_extend`: `base.extend_attention` is
    a kernel whose tokens are already position-only (native bf16, Triton); otherwise
    `token_attention` serves."""

    def __init__(self, base: TorchOps, kernel_extend: bool) -> None:
        self.base, self.kernel_extend = base, kernel_extend

    def paged_decode(self, num_heads, num_kv_heads, head_dim):
        return False  # no decode group: decode rows are one-token prompt rows

    def paged_extend(self, dtype, num_heads, num_kv_heads, head_dim):
        return True  # every row reads its context from the pool

    def extend_attention(self, q, k_buf, v_buf, kv_pages, starts, lens, page_size, scale):
        h, d = q.shape[1:]
        if self.kernel_extend and self.base.paged_extend(q.dtype, h, k_buf.shape[1], d):
            return self.base.extend_attention(q, k_buf, v_buf, kv_pages, starts, lens,
                                              page_size, scale)
        return token_attention(q, k_buf, v_buf, kv_pages, starts, lens, page_size, scale)


def token_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    kv_pages: torch.Tensor, starts: tuple[int, ...], lens: tuple[int, ...],
                    page_size: int, scale: float) -> torch.Tensor:
    """Causal attention where each new token is computed alone, over exactly its context
    (keys 0..position), in float32: the same inputs reach the same ops of the same shapes
    whatever the batch, the chunk, or decode vs prompt, so the bits are the token's own.
    Slow (a few small ops per token and layer): the path for dtypes and devices without a
    position-only kernel. q [T, H, D] (rows' new tokens, consecutive); pools [slots, Hkv, D];
    kv_pages [B, P] -> [T, H*D]."""
    t, h, d = q.shape
    hkv = k_buf.shape[1]
    g = h // hkv
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    first = 0
    for i, (start, n) in enumerate(zip(starts, lens, strict=True)):
        ctx = start + n
        pages = kv_pages[i:i + 1, :-(-ctx // page_size)]
        keys = _gather_pages(k_buf, pages, page_size)[0, :, :ctx].float()  # [Hkv, ctx, D]
        values = _gather_pages(v_buf, pages, page_size)[0, :, :ctx].float()
        for j in range(n):
            L = start + j + 1
            qt = q[first + j].float().view(hkv, g, d)  # [Hkv, G, D]
            s = torch.matmul(qt, keys[:, :L].transpose(1, 2)) * scale  # [Hkv, G, L]
            p = torch.softmax(s, dim=-1)
            out[first + j] = torch.matmul(p, values[:, :L]).view(h, d).to(q.dtype)
        first += n
    return out.view(t, h * d)


def wrap(base: TorchOps, backend: str) -> BatchInvariantOps:
    """The batch-invariant form of an attention choice's ops (`backend`: native | triton |
    torch). The native and Triton extend kernels are position-only; SDPA is not."""
    if backend == "triton":
        from pdserve.kernels import triton_matmul

        return BatchInvariantOps(base, kernel_extend=True, gemm=triton_matmul.linear)
    return BatchInvariantOps(base, kernel_extend=backend == "native")
