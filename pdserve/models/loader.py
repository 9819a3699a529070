"""Load a local HF folder into our `CausalLM`: config check, safetensors weights, dtype."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.models.builtin import resolve_model
from pdserve.models.llama import SUPPORTED_ARCHS, CausalLM

# Present in a synthetic model's folder (pdserve/models/tiny.py): no weights on disk.
RANDOM_INIT = "random_init.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    path: Path
    hf_config: object
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


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def eos_ids(path: Path, cfg) -> list[int]:
    ids = getattr(cfg, "eos_token_id", None)
    gen = path / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def fuse_hf_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> ours: q/k/v and gate/up weights (and biases) concatenated
    along the output dim into `qkv_proj` / `gate_up_proj` (see `pdserve.models.llama`)."""
    out = dict(state)
    for key in [k for k in state if ".q_proj." in k or ".gate_proj." in k]:
        for fused, parts in FUSED:
            if f".{parts[0]}." not in key:
                continue
            names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            if all(n in out for n in names):
                out[key.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat(
                    [out.pop(n) for n in names], dim=0)
    return out


def _load_weights(model: CausalLM, path: Path) -> None:
    state = _read_weights(path)
    state = fuse_hf_weights({k: v for k, v in state.items() if "rotary_emb" not in k})
    if model.tie:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"weights of {path} do not fit: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def random_model(path: Path, cfg, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """A synthetic model's weights, drawn on the device itself: nothing is read from disk or
    copied from the host, so a ~1B-parameter benchmark model appears in seconds on a GPU.
    Matrices ~ N(0, std), norms 1, biases 0, from a generator seeded by the folder's
    `random_init.json`: every process on the same kind of device builds the same model."""
    spec = json.loads((path / RANDOM_INIT).read_text())
    with torch.device(device):
        model = CausalLM(cfg)
    model.to(dtype)
    gen = torch.Generator(device=device).manual_seed(int(spec["seed"]))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, float(spec["std"]), generator=gen)
    return model


def load_model(name: str, dtype: str, device: torch.device, cache_dir: str = "") -> LoadedModel:
    path = resolve_model(name, cache_dir)
    cfg = load_hf_config(path)
    torch_dtype = pick_dtype(dtype, cfg, device)
    if (path / RANDOM_INIT).exists():
        model = random_model(path, cfg, device, torch_dtype)
    else:
        model = CausalLM(cfg)
        _load_weights(model, path)
    model.to(device=device, dtype=torch_dtype).eval()
    model.rotary.inv_freq = model.rotary.inv_freq.float()  # rope stays fp32 like HF
    ctx = int(getattr(cfg, "max_position_embeddings", 2048))
    window = getattr(cfg, "sliding_window", None)
    if window and (cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
        ctx = min(ctx, int(window))  # inside the window, full attention is exact
    return LoadedModel(path, cfg, model, torch_dtype, device, eos_ids(path, cfg), ctx)
