"""Attention backends: what serves the attention of decode rows and prompt rows.

The decoder's small ops (norms, rope, SiLU, linears) come from `--kernels`
(pdserve/models/ops.py); attention comes from `--attention-backend`, chosen once at start:

- `triton`: Triton kernels that read the paged pool in place (pdserve/kernels/
  triton_attention.py): flash-decoding for decode rows, ragged causal extend for prompt
  rows, so a mixed batch pads nothing and gathers no context. The default on CUDA.
  On CPU only under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI tests it.
- `native`: the fused CPU kernels' paged attention (needs `--kernels native`, or `auto`
  where they build). The default on CPU when they build.
- `torch`: SDPA: causal SDPA on a fresh prompt's own k/v, every other row's context
  gathered by page into SDPA with a padded mask.

`auto` picks triton on CUDA (torch where Triton cannot be imported), native on CPU when the
fused kernels are in use, else torch. `/server_info` → `engine.attention_backend` says
which, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.models.ops import TorchOps

ATTENTION_BACKENDS = ("auto", "triton", "native", "torch")


class TritonAttention:
    """The attention half of an ops object, in Triton (see the module docstring)."""

    name = "triton"

    def __init__(self) -> None:
        from pdserve.kernels import triton_attention

        self.k = triton_attention
        self._rows = None  # ExtendRows of the current forward, shared by its layers

    def paged_decode(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return head_dim <= 256

    def paged_extend(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> bool:
        return head_dim <= 256

    def decode_attention(self, q, k_buf, v_buf, kv_pages, seq_lens, page_size, scale):
        return self.k.decode_attention(q, k_buf, v_buf, kv_pages, seq_lens, page_size, scale)

    def extend_attention(self, q, k_buf, v_buf, kv_pages, starts, lens, page_size, scale):
        rows = self._rows
        if rows is None or rows.key != (starts, lens) or rows.table.device != q.device:
            rows = self._rows = self.k.ExtendRows(starts, lens, q.device)
        return self.k.extend_attention(q, k_buf, v_buf, kv_pages, rows, page_size, scale)


class WithAttention(TorchOps):
    """Small ops of `base`, attention of `attention` (an ops object, or TritonAttention)."""

    def __init__(self, base: TorchOps, attention) -> None:
        self.base, self.attention = base, attention
        self.name = base.name

    def linear(self, x, w, b):
        return self.base.linear(x, w, b)

    def rms_norm(self, x, w, eps):
        return self.base.rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        return self.base.add_rms_norm(x, residual, w, eps)

    def silu_and_mul(self, gate_up):
        return self.base.silu_and_mul(gate_up)

    def rope_and_store(self, qkv, cos, sin, k_buf, v_buf, slots, h, hkv):
        return self.base.rope_and_store(qkv, cos, sin, k_buf, v_buf, slots, h, hkv)

    def paged_decode(self, num_heads, num_kv_heads, head_dim):
        return self.attention.paged_decode(num_heads, num_kv_heads, head_dim)

    def paged_extend(self, dtype, num_heads, num_kv_heads, head_dim):
        return self.attention.paged_extend(dtype, num_heads, num_kv_heads, head_dim)

    def decode_attention(self, q, k_buf, v_buf, kv_pages, seq_lens, page_size, scale):
        return self.attention.decode_attention(q, k_buf, v_buf, kv_pages, seq_lens,
                                               page_size, scale)

    def extend_attention(self, q, k_buf, v_buf, kv_pages, starts, lens, page_size, scale):
        return self.attention.extend_attention(q, k_buf, v_buf, kv_pages, starts, lens,
                                               page_size, scale)


@dataclass(frozen=True)
class AttentionChoice:
    ops: TorchOps  # the small ops with the chosen attention
    backend: str  # triton | native | torch
    reason: str


def choose_attention(requested: str, base: TorchOps, device: torch.device) -> AttentionChoice:
    """`base` is the `--kernels` choice; raises ValueError for a backend that cannot run."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {'|'.join(ATTENTION_BACKENDS)}, "
                         f"got {requested!r}")
    native = base.name == "native"
    if requested == "auto":
        if device.type == "cuda":
            why = _triton_unavailable(device)
            if why is None:
                return _triton(base, f"{device.type}: paged Triton kernels")
            return AttentionChoice(WithAttention(base, TorchOps()), "torch", why)
        if native:
            return AttentionChoice(base, "native", "cpu: the fused kernels' paged attention")
        return AttentionChoice(base, "torch", "cpu without the fused kernels: SDPA")
    if requested == "triton":
        why = _triton_unavailable(device)
        if why is not None:
            raise ValueError(f"--attention-backend triton: {why}")
        return _triton(base, "requested")
    if requested == "native":
        if not native:
            raise ValueError("--attention-backend native needs the fused CPU kernels "
                             f"(--kernels native on CPU); this node runs {base.name} ops on "
                             f"{device.type}")
        return AttentionChoice(base, "native", "requested")
    return AttentionChoice(WithAttention(base, TorchOps()), "torch", "requested")


def _triton(base: TorchOps, reason: str) -> AttentionChoice:
    return AttentionChoice(WithAttention(base, TritonAttention()), "triton", reason)


def _triton_unavailable(device: torch.device) -> str | None:
    try:
        from pdserve.kernels import triton_attention
    except ImportError as exc:
        return f"Triton cannot be imported ({exc})"
    return triton_attention.available(device)
