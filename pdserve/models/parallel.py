"""Tensor parallelism of our `CausalLM`: which heads a rank owns, and sharding a loaded
model in place (docs/architecture.md: Tensor parallelism).

Megatron layout. Column-parallel: `qkv_proj` keeps this rank's q heads and its KV heads
(q, k and v are sliced *separately* out of the fused weight, then fused again per rank) and
`gate_up_proj` this rank's slice of gate and of up. Row-parallel: `o_proj` / `down_proj`
keep the matching input columns; their partial sums are all-reduced, then the bias (once)
is added. The embedding is replicated; the LM head is vocab-parallel (rows padded to a
multiple of the TP size) and all-gathered, so every rank holds the full logits and rank 0
samples. Norms and rope are replicated.

KV heads: with Hkv >= N each rank owns Hkv/N of them; with fewer KV heads than ranks (GQA)
each rank holds the one KV head its q heads read, so a KV head is replicated on N/Hkv ranks
(as SGLang and vLLM do). Anything else (N does not divide H, or Hkv and N do not divide
one another, or N does not divide the MLP width) is refused by `plan_tp`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pdserve.models.llama import MLP, Attention, CausalLM


class Comm(Protocol):
    """The collectives a sharded model needs (pdserve.engine.tp_group.TPGroup)."""

    def all_reduce(self, t: torch.Tensor) -> None: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class TPPlan:
    """What rank `rank` of `size` owns. Heads are model-global indices."""

    size: int
    rank: int
    heads: int  # H of the model
    kv_heads: int  # Hkv of the model
    head_dim: int
    local_heads: int  # q heads of this rank: [q_start, q_start + local_heads)
    q_start: int
    local_kv_heads: int  # KV heads of this rank: [kv_start, kv_start + local_kv_heads)
    kv_start: int

    @property
    def kv_replicated(self) -> bool:
        return self.kv_heads < self.size


def plan_tp(hf, size: int, rank: int = 0) -> TPPlan:
    """Raise ValueError with a readable reason when `size` ranks cannot shard this model."""
    h, hkv = hf.num_attention_heads, hf.num_key_value_heads
    d = getattr(hf, "head_dim", None) or hf.hidden_size // h
    name = getattr(hf, "_name_or_path", "") or hf.model_type
    if size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {size}")
    if h % size:
        raise ValueError(f"--tp-size {size} does not divide the {h} attention heads of "
                         f"{name}: use a TP size that divides {h}")
    if hkv % size and size % hkv:
        raise ValueError(f"--tp-size {size} cannot split the {hkv} KV heads of {name}: the "
                         f"TP size must divide the KV heads or be a multiple of them")
    if hf.intermediate_size % size:
        raise ValueError(f"--tp-size {size} does not divide the MLP width "
                         f"{hf.intermediate_size} of {name}")
    local_h = h // size
    if hkv >= size:
        local_kv, kv_start = hkv // size, rank * (hkv // size)
    else:  # replicate: the KV head of this rank's q heads
        local_kv, kv_start = 1, rank // (size // hkv)
    return TPPlan(size, rank, h, hkv, d, local_h, rank * local_h, local_kv, kv_start)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: x arrives already split by columns."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        y = F.linear(x, self.weight) if ops is None else ops.linear(x, self.weight, None)
        self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _column(layer: nn.Linear, parts) -> nn.Linear:
    """This rank's rows of a fused column-parallel layer: `parts(t)` cuts this rank's slice
    out of each fused piece of a weight or bias `t`; the slices are fused again."""
    w = torch.cat(parts(layer.weight.data)).contiguous()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None,
                    device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if layer.bias is not None:
            lin.bias.copy_(torch.cat(parts(layer.bias.data)))
    return lin.requires_grad_(False)


def _row(layer: nn.Linear, cols: slice, comm: Comm) -> RowParallelLinear:
    """This rank's input columns of a row-parallel layer (the bias is added once, after the
    all-reduce)."""
    bias = None if layer.bias is None else layer.bias.data
    return RowParallelLinear(layer.weight.data[:, cols].contiguous(), bias, comm)


def _shard_attention(attn: Attention, p: TPPlan, comm: Comm) -> None:
    d, qd, kd = p.head_dim, p.heads * p.head_dim, p.kv_heads * p.head_dim
    qs, ks = slice(p.q_start * d, (p.q_start + p.local_heads) * d), \
        slice(p.kv_start * d, (p.kv_start + p.local_kv_heads) * d)

    def parts(t: torch.Tensor) -> list[torch.Tensor]:  # fused rows: q [qd], k [kd], v [kd]
        q, k, v = t[:qd], t[qd:qd + kd], t[qd + kd:]
        return [q[qs], k[ks], v[ks]]

    assert isinstance(attn.o_proj, nn.Linear), "a layer is sharded once"
    attn.qkv_proj = _column(attn.qkv_proj, parts)
    attn.o_proj = _row(attn.o_proj, qs, comm)
    attn.num_heads, attn.num_kv_heads = p.local_heads, p.local_kv_heads


def _shard_mlp(mlp: MLP, p: TPPlan, comm: Comm) -> None:
    inter = mlp.gate_up_proj.weight.shape[0] // 2
    local = inter // p.size
    cols = slice(p.rank * local, (p.rank + 1) * local)

    def parts(t: torch.Tensor) -> list[torch.Tensor]:  # fused rows: gate [inter], up [inter]
        return [t[:inter][cols], t[inter:][cols]]

    assert isinstance(mlp.down_proj, nn.Linear), "a layer is sharded once"
    mlp.gate_up_proj = _column(mlp.gate_up_proj, parts)
    mlp.down_proj = _row(mlp.down_proj, cols, comm)


def _vocab_parallel_logits(x: torch.Tensor, weight: torch.Tensor, vocab: int, comm: Comm,
                           ops) -> torch.Tensor:
    """x [R, hidden] -> full logits [R, V] on every rank: local rows, then all-gather."""
    local = ops.linear(x, weight, None).float()
    if x.shape[0] == 0:  # every rank sees the same R (the batch is broadcast)
        return local.new_zeros(0, vocab)
    return torch.cat(comm.all_gather(local.contiguous()), dim=1)[:, :vocab]


def shard_model(model: CausalLM, p: TPPlan, comm: Comm) -> None:
    """Shard a fully loaded `CausalLM` in place for rank `p.rank` (frees the other slices)."""
    if p.size == 1:
        return
    for layer in model.model.decoder_layers:
        _shard_attention(layer.self_attn, p, comm)
        _shard_mlp(layer.mlp, p, comm)
    head = model.model.embed_tokens.weight if model.tie else model.lm_head.weight
    vocab = head.shape[0]
    per = -(-vocab // p.size)
    rows = head.data[p.rank * per:(p.rank + 1) * per]
    if rows.shape[0] < per:  # the last rank's slice is padded with zero rows
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
    if not model.tie:
        del model.lm_head
    model.tp_head = tp_head = rows.contiguous()
    model.tp_logits = functools.partial(_vocab_parallel_logits, weight=tp_head, vocab=vocab,
                                        comm=comm, ops=model.ops)
