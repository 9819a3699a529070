"""Load a checkpoint into our `CausalLM`: config check, safetensors weights streamed shard by
shard onto the device (or random weights of its shape), dtype."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdserve.models.builtin import resolve_model
from pdserve.models.llama import SUPPORTED_ARCHS, CausalLM
from pdserve.models.rope import RotaryEmbedding

# Present in a synthetic model's folder (pdserve/models/tiny.py): no weights on disk.
RANDOM_INIT = "random_init.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    path: Path
    hf_config: Any  # a transformers PretrainedConfig
    model: CausalLM
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: list[int]
    context_length: int


def load_hf_config(path: Path):
    from transformers import AutoConfig

    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if not any(a in SUPPORTED_ARCHS for a in archs):
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {path}: "
            f"pdserve serves {', '.join(SUPPORTED_ARCHS)}"
        )
    return AutoConfig.from_pretrained(path)


def pick_dtype(name: str, cfg, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are slow on most CPUs
    ckpt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    return ckpt if isinstance(ckpt, torch.dtype) else DTYPES.get(str(ckpt), torch.bfloat16)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else every file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / f for f in shards]
        if missing := [f.name for f in files if not f.exists()]:
            raise ValueError(f"{path}: shards named by its index are missing: {missing[:5]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path}")
    return files


def eos_ids(path: Path, cfg) -> list[int]:
    ids = getattr(cfg, "eos_token_id", None)
    gen = path / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def _fused_rows(cfg) -> dict[str, tuple[str, int]]:
    """HF projection name -> (our fused parameter, first row), e.g. 'k_proj' ->
    ('qkv_proj', H * D): where a checkpoint tensor lands in `qkv_proj` / `gate_up_proj`."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rows = {"q_proj": cfg.num_attention_heads * d, "k_proj": cfg.num_key_value_heads * d,
            "v_proj": cfg.num_key_value_heads * d, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size}
    out = {}
    for fused, parts in FUSED:
        start = 0
        for part in parts:
            out[part] = (fused, start)
            start += rows[part]
    return out


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """nn.Linear and nn.Embedding draw random weights in __init__; on the meta device that
    runs torch's reference ops, which import torch._dynamo (seconds, and a cache folder
    left in TMPDIR). Weights about to be overwritten need no init."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = lambda self: None  # type: ignore[method-assign]
    nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore


def _empty_model(cfg, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Our model with uninitialised parameters already in `dtype` on `device`: built on the
    meta device, so no host copy and no random init of weights about to be overwritten.
    Rope's inverse frequencies are computed for real (they are not in checkpoints) and
    rounded through `dtype` as `Module.to(dtype)` does, so both load paths give the same
    bits."""
    with torch.device("meta"), _no_random_init():
        model = CausalLM(cfg)
    model.to(dtype).to_empty(device=device)
    model.rotary = RotaryEmbedding(cfg)
    model.rotary.inv_freq = model.rotary.inv_freq.to(dtype).float().to(device)
    return model


def stream_weights(model: CausalLM, path: Path) -> None:
    """Copy a checkpoint into `model`'s parameters one tensor at a time, shard after shard
    (a 16 GB model never has a second copy anywhere; on CUDA safetensors reads straight to
    the device). q/k/v and gate/up land in their rows of the fused projections, wherever
    the shards put them. Raises ValueError naming missing, unexpected or misshapen tensors."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    fused = _fused_rows(model.config)
    filled: dict[str, int] = {}  # parameter -> elements written
    unexpected, misshapen = [], []
    device = next(iter(params.values())).device
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device=str(device)) as shard:
            for key in shard.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if "rotary_emb" in key or (model.tie and key == "lm_head.weight"):
                    continue
                name, start = key, 0
                for part, (target, first) in fused.items():
                    if f".{part}." in key:
                        name, start = key.replace(f".{part}.", f".{target}."), first
                        break
                if name not in params:
                    unexpected.append(key)
                    continue
                t = shard.get_tensor(key)
                dst = params[name].data[start:start + t.shape[0]] if t.dim() else None
                if dst is None or dst.shape != t.shape:
                    misshapen.append(f"{key} {tuple(t.shape)}")
                    continue
                with torch.no_grad():
                    dst.copy_(t)
                filled[name] = filled.get(name, 0) + t.numel()
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing or unexpected or misshapen:
        raise ValueError(f"weights of {path} do not fit: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, misshapen {misshapen[:5]}")


def random_model(cfg, device: torch.device, dtype: torch.dtype, seed: int,
                 std: float) -> CausalLM:
    """Random weights of the checkpoint's shape, drawn on the device itself: nothing is read
    from disk or copied from the host, so a ~1B-parameter benchmark model appears in seconds
    on a GPU. Matrices ~ N(0, std), norms 1, biases 0, from a generator seeded by `seed`:
    every process on the same kind of device builds the same model (the two nodes of a PD
    pair must)."""
    model = _empty_model(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    return model


LOAD_FORMATS = ("auto", "dummy")
DUMMY_SEED = 0  # one seed for every node: prefill and decode must hold the same weights


def load_model(name: str, dtype: str, device: torch.device, cache_dir: str = "",
               revision: str = "", load_format: str = "auto") -> LoadedModel:
    """`load_format`: auto reads the checkpoint's safetensors; dummy draws random weights
    of its shape (config and tokenizer only are read: benchmarks of big models)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = resolve_model(name, cache_dir, revision=revision, weights=load_format == "auto")
    cfg = load_hf_config(path)
    torch_dtype = pick_dtype(dtype, cfg, device)
    if (path / RANDOM_INIT).exists():
        spec = json.loads((path / RANDOM_INIT).read_text())
        model = random_model(cfg, device, torch_dtype, int(spec["seed"]), float(spec["std"]))
    elif load_format == "dummy":
        model = random_model(cfg, device, torch_dtype, DUMMY_SEED,
                             float(getattr(cfg, "initializer_range", 0.02)))
    else:
        model = _empty_model(cfg, device, torch_dtype)
        stream_weights(model, path)
    model.eval()
    ctx = int(getattr(cfg, "max_position_embeddings", 2048))
    window = getattr(cfg, "sliding_window", None)
    if window and (cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
        ctx = min(ctx, int(window))  # inside the window, full attention is exact
    return LoadedModel(path, cfg, model, torch_dtype, device, eos_ids(path, cfg), ctx)
