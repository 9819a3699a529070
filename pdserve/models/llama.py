"""Our Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with qk-norm).

Parameter names mirror the HF checkpoints except two fused projections: q/k/v become
one `qkv_proj` and gate/up one `gate_up_proj` (`fuse_hf_weights` concatenates them at
load), so a layer runs 4 matmuls instead of 7: fewer, larger GEMMs are what a CPU (and
a GPU at small batch) runs efficiently.

Attention reads and writes the paged KV pool (docs/architecture.md, "Memory"): the new
tokens' K/V are copied into their slots, then each request's context is gathered *by
page* (one contiguous `page_size x Hkv x D` block per page, not one row per token) and
fed to torch SDPA with a padded [B, 1, Lq, Lk] mask. The index tensors are built once per
forward (`AttnMeta`) and shared by every layer.

Shapes: T = new tokens in the batch, B = requests, Lq = longest new-token run,
Lk = gathered context (pages x page_size), H / Hkv = query / KV heads, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.rope import RotaryEmbedding

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class AttnMeta:
    """Per-forward attention indices, on the model's device."""

    out_cache_loc: torch.Tensor  # [T] pool slot of each new token
    kv_pages: torch.Tensor  # [B, P] pool page of each context page (padded with page 0)
    mask: torch.Tensor  # [B, 1, Lq, P * page_size] bool, True = may attend
    q_index: torch.Tensor | None  # [T] flat position in the padded [B*Lq] layout; None when
    # every row has Lq new tokens (decode, or one prompt), so [T] already is [B*Lq]
    batch: int
    max_q: int
    page_size: int
    # HiCache: called with the layer id before the layer touches the pool, so a forward
    # waits only for the layers of a pending host->device load it is about to read.
    layer_wait: Callable[[int], None] | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as HF: normalise in fp32, scale in the input dtype.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        bias = attn_bias or cfg.model_type == "qwen2"  # Qwen2: q/k/v always biased
        h = cfg.hidden_size
        qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(h, qd + 2 * kd, bias=bias)  # rows: q, then k, then v
        self.o_proj = nn.Linear(qd, h, bias=attn_bias and cfg.model_type != "qwen2")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttnMeta, kv_pool) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, d)
        qk, v = qkv[:, : h + hkv], qkv[:, h + hkv:]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k heads rotated in one go
        q, k = qk[:, :h], qk[:, h:]
        if meta.layer_wait is not None:
            meta.layer_wait(self.layer_id)
        k_buf, v_buf = kv_pool.k_buffers[self.layer_id], kv_pool.v_buffers[self.layer_id]
        k_buf.index_copy_(0, meta.out_cache_loc, k)
        v_buf.index_copy_(0, meta.out_cache_loc, v)
        keys, values = _gather_pages(k_buf, meta), _gather_pages(v_buf, meta)
        b, lq = meta.batch, meta.max_q
        if meta.q_index is None:
            qp = q.reshape(b, lq, h, d)
        else:
            qp = q.new_zeros(b * lq, h, d)
            qp[meta.q_index] = q
            qp = qp.view(b, lq, h, d)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=self.scale,
            enable_gqa=h != hkv,
        )  # [B, H, Lq, D]
        out = out.transpose(1, 2).reshape(b * lq, h * d)
        if meta.q_index is not None:
            out = out[meta.q_index]
        return self.o_proj(out)


def _gather_pages(buf: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """[slots, Hkv, D] pool buffer -> [B, Hkv, P*page_size, D] context of each row.
    Indexing whole pages copies page-sized contiguous blocks instead of single rows."""
    b, pages = meta.kv_pages.shape
    hkv, d = buf.shape[1:]
    paged = buf.view(-1, meta.page_size, hkv, d)
    return paged[meta.kv_pages].view(b, pages * meta.page_size, hkv, d).transpose(1, 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos: [T, D]; sin: [T, D] with its first half negated (see
    `RotaryEmbedding`), so HF's `x*cos + rotate_half(x)*sin` is one swap of halves."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + swapped * sin.unsqueeze(1)


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=bias)  # gate; up
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_pool):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], meta, kv_pool, logit_rows [R]) -> logits [R, V]`."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttnMeta, kv_pool, logit_rows) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta, kv_pool)
        return self.compute_logits(self.model.norm(x[logit_rows]))

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, V] fp32 (replaced per instance under TP: models/parallel.py)."""
        weight = self.model.embed_tokens.weight if self.tie else self.lm_head.weight
        return F.linear(x, weight).float()
