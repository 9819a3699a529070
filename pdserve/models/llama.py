"""Our Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with qk-norm).

Parameter names mirror the HF checkpoints except two fused projections: q/k/v become
one `qkv_proj` and gate/up one `gate_up_proj` (the loader copies each into its rows at
load), so a layer runs 4 matmuls instead of 7: fewer, larger GEMMs are what a CPU (and
a GPU at small batch) runs efficiently.

Attention reads and writes the paged KV pool (docs/architecture.md, "Memory"): the new
tokens' K/V are written into their slots; decode rows (one new token each, in a decode or
a mixed batch) then attend straight from the pool when the ops have a paged decode kernel
(native CPU kernels, Triton), else by SDPA over their own pages gathered, never padded to a
prompt row's length; prompt rows use the ops' paged extend kernel where there is one;
otherwise prompts that start at position 0 attend with causal SDPA over their own k/v and
every other prompt row gathers its context *by page* (one contiguous `page_size x Hkv x D`
block per page) into SDPA with a padded [B, 1, Lq, Lk] mask over the prompt rows only. The
index tensors are built once per forward (`AttnMeta`) and shared by every layer. The small
ops (norms, rope, SiLU) come from `self.ops` (pdserve/models/ops.py): torch reference ops
or the fused CPU kernels, chosen by `--kernels`.

Shapes: T = new tokens in the batch, B = requests, Lq = longest new-token run,
Lk = gathered context (pages x page_size), H / Hkv = query / KV heads, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.ops import TorchOps
from pdserve.models.rope import RotaryEmbedding

if TYPE_CHECKING:  # parallel.py swaps it in under TP; it imports this module
    from pdserve.models.parallel import RowParallelLinear

TORCH_OPS = TorchOps()

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class AttnMeta:
    """Per-forward attention indices, on the model's device.

    A batch's rows fall in two groups (docs/architecture.md: "Engine speed"): the first
    `batch` rows, whose tokens come first, are prompt rows (fresh, or continuing a cached
    context); the last `len(seq_lens)` rows, one token each, are decode rows that read the
    paged pool in place (`ops.decode_attention`) or, without a paged kernel, SDPA over their
    own gathered pages. A pure decode batch has `batch == 0`; a mixed batch has both groups.
    No row is ever padded to another's length."""

    out_cache_loc: torch.Tensor  # [T] pool slot of each new token
    kv_pages: torch.Tensor  # [B, P] pool page of each context page (padded with page 0)
    batch: int  # rows of the prompt group
    page_size: int
    # The decode group: [Bd] context length incl. the new token, and [Bd, Pd] its pages.
    seq_lens: torch.Tensor | None = None
    decode_pages: torch.Tensor | None = None
    # new-token count of each prompt row when all of them start at position 0 (fresh
    # prompts, first chunks) and the ops have no paged extend kernel: their context is
    # exactly this batch's k/v, so attention needs no pool read.
    fresh_lens: tuple[int, ...] | None = None
    # Otherwise the cached tokens and new tokens of each prompt row: read from the pool in
    # place when the ops have a paged extend kernel (`ops.extend_attention`: Triton, bf16 on
    # AVX512-BF16 CPUs), else each row's own pages gathered (`_gathered_extend`).
    extend_starts: tuple[int, ...] | None = None
    extend_lens: tuple[int, ...] | None = None
    # HiCache: called with the layer id before the layer touches the pool, so a forward
    # waits only for the layers of a pending host->device load it is about to read.
    layer_wait: Callable[[int], None] | None = None


class RMSNorm(nn.Module):
    """Holds the weight; the backbone applies it through its ops (`ops.rms_norm`), so the
    fused residual-add + norm can run as one kernel. `forward` is the reference (qk-norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_OPS.rms_norm(x, self.weight, self.eps)


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
        # Row-parallel once sharded for TP (models/parallel.py).
        self.o_proj: nn.Linear | RowParallelLinear = nn.Linear(
            qd, h, bias=attn_bias and cfg.model_type != "qwen2")
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttnMeta, kv_pool, ops: TorchOps) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = _linear(ops, self.qkv_proj, x).view(t, h + 2 * hkv, d)
        if self.qk_norm:
            qkv = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h:h + hkv]),
                             qkv[:, h + hkv:]), dim=1)
        if meta.layer_wait is not None:
            meta.layer_wait(self.layer_id)  # HiCache: this layer's pages are loaded
        k_buf, v_buf = kv_pool.k_buffers[self.layer_id], kv_pool.v_buffers[self.layer_id]
        q, k, v = ops.rope_and_store(qkv, cos, sin, k_buf, v_buf, meta.out_cache_loc, h, hkv)
        n_dec = 0 if meta.seq_lens is None else meta.seq_lens.shape[0]
        outs = []
        if meta.batch:  # prompt rows: tokens [0, t - n_dec) -> [te, H*D]
            te = t - n_dec
            if meta.fresh_lens is not None:
                outs.append(_fresh_attention(q[:te], k[:te], v[:te], meta.fresh_lens,
                                             self.scale))
            else:
                starts, lens = meta.extend_starts, meta.extend_lens
                assert starts is not None and lens is not None  # set when fresh_lens is not
                attend = ops.extend_attention if self.paged_extend(ops, q.dtype) \
                    else _gathered_extend
                outs.append(attend(q[:te], k_buf, v_buf, meta.kv_pages, starts, lens,
                                   meta.page_size, self.scale))
        if n_dec:  # decode rows: the last n_dec tokens, one per row
            pages, seq_lens = meta.decode_pages, meta.seq_lens
            assert pages is not None and seq_lens is not None  # set with the decode group
            if ops.paged_decode(h, hkv, d):  # [Bd, H, D]
                out = ops.decode_attention(q[t - n_dec:], k_buf, v_buf, pages, seq_lens,
                                           meta.page_size, self.scale)
            else:
                out = _gathered_decode(q[t - n_dec:], k_buf, v_buf, pages, seq_lens,
                                       meta.page_size, self.scale)
            outs.append(out.view(n_dec, h * d))
        return _linear(ops, self.o_proj, outs[0] if len(outs) == 1 else torch.cat(outs))

    def paged_decode(self, ops: TorchOps) -> bool:
        return ops.paged_decode(self.num_heads, self.num_kv_heads, self.head_dim)

    def paged_extend(self, ops: TorchOps, dtype: torch.dtype) -> bool:
        return ops.paged_extend(dtype, self.num_heads, self.num_kv_heads, self.head_dim)


def _linear(ops: TorchOps, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(layer) is nn.Linear:
        return ops.linear(x, layer.weight, layer.bias)
    return layer(x, ops)  # a row-parallel linear under TP adds its all-reduce (parallel.py)


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     lens: tuple[int, ...], scale: float) -> torch.Tensor:
    """Rows whose context is exactly their new tokens (prompts from position 0): causal SDPA
    on this batch's own q/k/v, row by row: no gather from the pool, no mask tensor, and the
    kernel skips the blocks above the diagonal. q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]."""
    h, d = q.shape[1:]
    outs, start = [], 0
    for n in lens:
        rows = slice(start, start + n)
        out = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0), k[rows].transpose(0, 1).unsqueeze(0),
            v[rows].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
            enable_gqa=h != k.shape[1])  # [1, H, n, D]
        outs.append(out[0].transpose(0, 1).reshape(n, h * d))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _gathered_extend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_pages: torch.Tensor, starts: tuple[int, ...], lens: tuple[int, ...],
                     page_size: int, scale: float) -> torch.Tensor:
    """Prompt rows over a cached context (chunks, prefix hits) without a paged kernel: row
    by row, SDPA over that row's own context gathered from the pool ([1, Hkv, L_i, D], L_i =
    start_i + n_i) under its causal mask [n_i, L_i]. Temporaries are the sum over rows of
    n_i * L_i, never rows x the longest: a long chunk beside short prompts pads nothing.
    q [T, H, D] (rows' new tokens, consecutive) -> [T, H*D]."""
    h, d = q.shape[1:]
    outs, first = [], 0
    for i, (start, n) in enumerate(zip(starts, lens, strict=True)):
        ctx = start + n
        pages = kv_pages[i:i + 1, :-(-ctx // page_size)]
        keys = _gather_pages(k_buf, pages, page_size)[:, :, :ctx]  # [1, Hkv, L_i, D]
        values = _gather_pages(v_buf, pages, page_size)[:, :, :ctx]
        # a fresh prompt beside chunks: its square causal mask as the kernel's flag (the
        # masked kernel took ~1.45x as long for a 1024-token row on 2 CPU cores)
        mask = None
        if start:
            q_pos = torch.arange(start, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device).view(1, -1) <= q_pos.view(-1, 1)
        out = F.scaled_dot_product_attention(
            q[first:first + n].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
            is_causal=not start, scale=scale, enable_gqa=h != keys.shape[1])  # [1, H, n, D]
        outs.append(out[0].transpose(0, 1).reshape(n, h * d))
        first += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _gathered_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_pages: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                     scale: float) -> torch.Tensor:
    """Decode rows without a paged kernel: q [Bd, H, D] -> [Bd, H, D]. Only the decode rows'
    own pages are gathered ([Bd, Hkv, Pd*page_size, D], Pd their longest context), so a
    mixed batch never pads a decode row to a chunk's length; the mask [Bd, 1, 1, Lk] hides
    each row's keys past its length."""
    h = q.shape[1]
    keys = _gather_pages(k_buf, kv_pages, page_size)
    values = _gather_pages(v_buf, kv_pages, page_size)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    mask = (key_pos.view(1, -1) < seq_lens.view(-1, 1)).view(-1, 1, 1, keys.shape[2])
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=h != keys.shape[1])
    return out.squeeze(2)  # [Bd, H, 1, D] -> [Bd, H, D]


def _gather_pages(buf: torch.Tensor, kv_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[slots, Hkv, D] pool buffer, [B, P] pages -> [B, Hkv, P*page_size, D] context of each
    row. Indexing whole pages copies page-sized contiguous blocks instead of single rows."""
    b, pages = kv_pages.shape
    hkv, d = buf.shape[1:]
    paged = buf.view(-1, page_size, hkv, d)
    return paged[kv_pages].view(b, pages * page_size, hkv, d).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        # Row-parallel once sharded for TP (models/parallel.py).
        self.down_proj: nn.Linear | RowParallelLinear = nn.Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return _linear(ops, self.down_proj, ops.silu_and_mul(_linear(ops, self.gate_up_proj, x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, cos, sin, meta, kv_pool, ops: TorchOps) -> torch.Tensor:
        """h = input_layernorm(residual) on entry; adds attention and MLP to `residual` in
        place (HF: x = x + attn(norm(x)); x = x + mlp(norm(x))) and returns the MLP output,
        which the next layer's fused add + norm folds in."""
        a = self.self_attn(h, cos, sin, meta, kv_pool, ops)
        norm = self.post_attention_layernorm
        return self.mlp(ops.add_rms_norm(a, residual, norm.weight, norm.eps), ops)


class Backbone(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers` itself, typed: nn.ModuleList is not generic (its items type as Module),
        and this one only ever holds DecoderLayers."""
        return cast("Sequence[DecoderLayer]", self.layers)


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
        self.ops: TorchOps = TORCH_OPS  # the loader swaps in NativeOps (pdserve/models/ops.py)
        # Under TP: the vocab-parallel head that `compute_logits` calls instead (parallel.py).
        self.tp_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttnMeta, kv_pool, logit_rows) -> torch.Tensor:
        ops, layers = self.ops, self.model.decoder_layers
        residual = self.model.embed_tokens(input_ids)  # [T, hidden], the residual stream
        cos, sin = self.rotary(positions, residual.dtype)
        first = layers[0].input_layernorm
        h = ops.rms_norm(residual, first.weight, first.eps)
        for i, layer in enumerate(layers):
            m = layer(h, residual, cos, sin, meta, kv_pool, ops)
            if i + 1 < len(layers):
                nxt = layers[i + 1].input_layernorm
                h = ops.add_rms_norm(m, residual, nxt.weight, nxt.eps)
            else:
                residual.add_(m)
        norm = self.model.norm
        return self.compute_logits(ops.rms_norm(residual[logit_rows], norm.weight, norm.eps))

    def paged_decode(self) -> bool:
        """True when decode rows can read the paged pool in place (ops and head shapes)."""
        return self.model.decoder_layers[0].self_attn.paged_decode(self.ops)

    def paged_extend(self) -> bool:
        """True when prompt rows can attend over the paged pool in place (ops, dtype, heads)."""
        attn = self.model.decoder_layers[0].self_attn
        return attn.paged_extend(self.ops, self.model.embed_tokens.weight.dtype)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, V] fp32 (vocab-parallel under TP: models/parallel.py)."""
        if self.tp_logits is not None:
            return self.tp_logits(x)
        weight = self.model.embed_tokens.weight if self.tie else self.lm_head.weight
        return self.ops.linear(x, weight, None).float()
