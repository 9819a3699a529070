"""Rotary position embedding with the rope scaling types HF configs define.

The inverse frequencies come from transformers' own `ROPE_INIT_FUNCTIONS` (default,
linear, llama3, yarn, longrope, ...), so every scaling variant matches the reference
model exactly. `dynamic` NTK depends on the running sequence length and is rejected.
"""

from __future__ import annotations

import torch
from torch import nn


def _rope_params(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if not params:  # older configs: rope_theta + rope_scaling
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # [D/2], a non-persistent buffer

    def __init__(self, cfg) -> None:
        super().__init__()
        params = _rope_params(cfg)
        rope_type = params["rope_type"]
        if rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' is not supported")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Computed on the host whatever the default device (the loader builds the model on
        # the meta device, which has no real arithmetic); `Module.to` moves it.
        with torch.device("cpu"):
            if rope_type == "default":
                base = params["rope_theta"]
                inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float)
                                      / head_dim))
                scaling = 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                if rope_type not in ROPE_INIT_FUNCTIONS:
                    raise ValueError(f"unsupported rope_type {rope_type!r}")
                inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.attention_scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> (cos, sin) each [T, D] in `dtype` (computed in fp32 like HF).

        `sin`'s first half is negated: HF's rotate_half(x) is (-x2, x1), so
        `x*cos + (x2, x1)*sin_signed` gives the same bits with one op less per layer
        (negation is exact in floating point)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        sin[:, : sin.shape[1] // 2].neg_()
        return cos.to(dtype), sin.to(dtype)
