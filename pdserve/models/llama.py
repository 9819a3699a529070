"""Our Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with qk-norm).

Parameter names mirror the HF checkpoints, so safetensors load without renaming.
Attention reads and writes the paged KV pool (DESIGN §3): the new tokens' K/V are
scattered into their slots, then each request's whole context is gathered by slot
index and fed to torch SDPA with a padded [B, Lq, Lk] mask. The index tensors are built
once per forward (`AttnMeta`) and shared by every layer.

Shapes: T = new tokens in the batch, B = requests, Lq = longest new-token run,
Lk = longest context, H / Hkv = query / KV heads, D = head dim.
"""

from __future__ import annotations

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
    kv_indices: torch.Tensor  # [B, Lk] pool slot of each context token (padded with 0)
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool, True = may attend
    q_index: torch.Tensor | None  # [T] flat position in the padded [B*Lq] layout; None if Lq==1
    batch: int
    max_q: int


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
        self.q_proj = nn.Linear(h, qd, bias=bias)
        self.k_proj = nn.Linear(h, kd, bias=bias)
        self.v_proj = nn.Linear(h, kd, bias=bias)
        self.o_proj = nn.Linear(qd, h, bias=attn_bias and cfg.model_type != "qwen2")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttnMeta, kv_pool) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_buf, v_buf = kv_pool.k_buffers[self.layer_id], kv_pool.v_buffers[self.layer_id]
        k_buf[meta.out_cache_loc] = k
        v_buf[meta.out_cache_loc] = v
        keys = k_buf[meta.kv_indices].transpose(1, 2)  # [B, Hkv, Lk, D]
        values = v_buf[meta.kv_indices].transpose(1, 2)
        b, lq = meta.batch, meta.max_q
        if meta.q_index is None:
            qp = q.view(b, 1, self.num_heads, self.head_dim)
        else:
            qp = q.new_zeros(b * lq, self.num_heads, self.head_dim)
            qp[meta.q_index] = q
            qp = qp.view(b, lq, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, Lq, D]
        out = out.transpose(1, 2).reshape(b * lq, self.num_heads * self.head_dim)
        if meta.q_index is not None:
            out = out[meta.q_index]
        return self.o_proj(out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D] (halves duplicated, HF's rotate_half layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        x = self.model.norm(x[logit_rows])
        weight = self.model.embed_tokens.weight if self.tie else self.lm_head.weight
        return F.linear(x, weight).float()
