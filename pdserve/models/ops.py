"""The decoder layer's small ops, in two interchangeable implementations.

`TorchOps` is plain PyTorch and runs on any device: the reference, and what CUDA uses.
`NativeOps` calls the fused CPU kernels of pdserve/kernels/cpu_ops.cpp: each op is one pass
instead of a chain of eager ops (an RMSNorm is eight), and decode attention reads the paged
pool in place instead of gathering every context into a padded tensor first. Both round to
the storage dtype at the same points as HF's modelling code (docs/architecture.md: "Engine
speed"); the equivalence is tested op by op (tests/kernels/test_kernels.py) and end to end.

Shapes: T tokens, H / Hkv query / KV heads, D head dim, B requests, P pages per request.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

KERNEL_CHOICES = ("auto", "native", "torch")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos: [T, D]; sin: [T, D] with its first half negated (see
    `RotaryEmbedding`), so HF's `x*cos + rotate_half(x)*sin` is one swap of halves."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + swapped * sin.unsqueeze(1)


class TorchOps:
    name = "torch"
    def paged_decode(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """True when `decode_attention` reads the paged pool in place for this shape;
        False: the model gathers pages into SDPA instead."""
        return False

    def paged_extend(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> bool:
        """True when `extend_attention` serves prompt rows of this dtype and shape; False:
        SDPA on the batch's own k/v (fresh rows) or on pages gathered from the pool."""
        return False

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, w, b)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # HF's arithmetic: normalise in fp32, round to the input dtype, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x (in place), then rms_norm(residual)."""
        residual.add_(x)
        return self.rms_norm(residual, w, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate; up) -> [T, I]."""
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def rope_and_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                       h: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, H + 2 Hkv, D]: rotates q and k, writes k and v to pool `slots` [T];
        returns the rotated q [T, H, D], k [T, Hkv, D] and v [T, Hkv, D]."""
        qk = apply_rope(qkv[:, : h + hkv], cos, sin)  # q and k heads rotated in one go
        k_buf.index_copy_(0, slots, qk[:, h:])
        v_buf.index_copy_(0, slots, qkv[:, h + hkv:])
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv:]

    def decode_attention(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         kv_pages: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                         scale: float) -> torch.Tensor:
        raise NotImplementedError("TorchOps gathers pages instead (paged_decode)")

    def extend_attention(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         kv_pages: torch.Tensor, starts: tuple[int, ...],
                         lens: tuple[int, ...], page_size: int, scale: float) -> torch.Tensor:
        raise NotImplementedError("TorchOps runs SDPA instead (paged_extend)")


class NativeOps(TorchOps):
    name = "native"

    def __init__(self, module) -> None:
        self.m = module
        self.packed = PackedWeights()

    def linear(self, x, w, b):
        # One row in bfloat16 (a decode step of one request): the kernel reads w at memory
        # speed, 1.3-1.9x oneDNN's GEMM on AVX2, and still ahead of the packed one in a
        # whole decode step on AVX-512 BF16 (bench/forward.py: 8.1 vs 9.9 ms).
        if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.shape[1] % 32 == 0:
            return self.m.small_linear(x, w, b)
        if x.dtype in self.packed.dtypes and (wp := self.packed.get(w)) is not None:
            return torch.ops.mkldnn._linear_pointwise(x, wp, b, "none", [], "")
        return F.linear(x, w, b)

    def rms_norm(self, x, w, eps):
        return self.m.rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        return self.m.add_rms_norm(x, residual, w, eps)

    def silu_and_mul(self, gate_up):
        return self.m.silu_and_mul(gate_up)

    def rope_and_store(self, qkv, cos, sin, k_buf, v_buf, slots, h, hkv):
        flat = qkv.view(qkv.shape[0], -1)  # rows contiguous: the kernel rotates in place
        self.m.rope_and_store(flat, cos, sin, k_buf, v_buf, slots, h, hkv)
        return qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:]

    def paged_decode(self, num_heads, num_kv_heads, head_dim):
        # the kernel's vector loop: 16-float chunks, at most 16 query heads per KV head
        return head_dim % 16 == 0 and head_dim <= 256 and num_heads // num_kv_heads <= 16

    def decode_attention(self, q, k_buf, v_buf, kv_pages, seq_lens, page_size, scale):
        """q [B, H, D] -> [B, H, D]: each row's one new token over its whole context."""
        return self.m.decode_attention(q, k_buf, v_buf, kv_pages, seq_lens, page_size, scale)

    def paged_extend(self, dtype, num_heads, num_kv_heads, head_dim):
        # bf16 only: the kernel's products are VDPBF16PS (AVX512-BF16); float32 keeps SDPA,
        # whose summation order the float32 exactness tests against transformers rely on.
        return (dtype == torch.bfloat16 and self.m.has_extend_attention()
                and head_dim % 16 == 0 and head_dim <= 256)

    def extend_products(self, head_dim: int) -> str:
        """What the prompt kernel multiplies on: AMX tiles where the build has them, the OS
        grants them and head_dim % 32 == 0, else AVX512-BF16's VDPBF16PS."""
        return "amx" if self.m.extend_attention_amx(head_dim) else "avx512_bf16"

    def extend_attention(self, q, k_buf, v_buf, kv_pages, starts, lens, page_size, scale):
        """q [T, H, D] (rows' new tokens, consecutive) -> [T, H*D]: causal attention over
        each row's whole context, read from the pool in place."""
        return self.m.extend_attention(q, k_buf, v_buf, kv_pages, list(starts), list(lens),
                                       page_size, scale)


class PackedWeights:
    """Weights reordered once into oneDNN's blocked layout (the layout vLLM's CPU linears
    use too). torch's default GEMM re-packs the weight on every call, which dominates a
    decode step's small-row products. float32, measured on a 2-core AVX2 EPYC: SmolLM2's
    gate_up [3072, 576] at 1/16/512 rows 0.24/0.80/21 ms -> 0.14/0.47/13 ms, the 49152-row
    LM head at 1 row 10 -> 4 ms. bfloat16 where oneDNN runs it natively (AVX-512 BF16 /
    AMX; `dtypes` says which), on a 2-core AVX-512 BF16 EPYC: gate_up at 1/16/64 rows
    0.11/0.18/0.38 -> 0.04/0.08/0.24 ms, the LM head at 16 rows 2.5 -> 1.6 ms, and the same
    products as F.linear. Costs a second copy of every packed weight (the model keeps its
    own for the torch ops). float32 results differ from F.linear only in summation order.
    Keyed by the weight tensor; weights never change after loading."""

    def __init__(self) -> None:
        self._by_weight: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.dtypes: set[torch.dtype] = set()
        if torch.backends.mkldnn.is_available():
            self.dtypes.add(torch.float32)
            with contextlib.suppress(RuntimeError, AttributeError):
                if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                    self.dtypes.add(torch.bfloat16)

    def get(self, w: torch.Tensor) -> torch.Tensor | None:
        """The packed form of CPU weight `w` [N, K] (a dtype of `dtypes`), or None (use
        F.linear)."""
        if (entry := self._by_weight.get(id(w))) is not None:
            return entry[1]  # the entry holds w, so no other tensor can have its id
        packed = None
        if w.dtype in self.dtypes and w.dim() == 2 and w.device.type == "cpu":
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())
            except (RuntimeError, AttributeError):  # a torch without oneDNN linears
                self.dtypes.discard(w.dtype)
        self._by_weight[id(w)] = (w, packed)
        return packed


@dataclass(frozen=True)
class OpsChoice:
    ops: TorchOps
    kind: Literal["native", "torch"]
    reason: str


def choose_ops(requested: str, device: torch.device) -> OpsChoice:
    """`auto`: the native kernels on CPU when they build here, torch ops otherwise (CUDA
    runs torch's own fused kernels). `native` on a machine that cannot build them fails."""
    if requested not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {'|'.join(KERNEL_CHOICES)}, got {requested!r}")
    if requested == "torch":
        return OpsChoice(TorchOps(), "torch", "requested")
    if device.type != "cpu":
        if requested == "native":
            raise ValueError("--kernels native runs on CPU only; use auto or torch on "
                             f"{device.type}")
        return OpsChoice(TorchOps(), "torch", f"{device.type}: torch's own kernels")
    from pdserve.kernels import build_error, load_cpu_ops

    module = load_cpu_ops()
    if module is None:
        if requested == "native":
            raise RuntimeError(f"--kernels native: the CPU kernels do not build here: "
                               f"{build_error()}")
        return OpsChoice(TorchOps(), "torch", f"native kernels unavailable: {build_error()}")
    from pdserve.kernels import build_id

    return OpsChoice(NativeOps(module), "native", f"cpu: fused kernels {build_id()}")
