"""Small random models (~4M parameters) for fast tests, generated deterministically.

They reuse SmolLM2's tokenizer (a real BPE with a chat template). Weights use a larger
init scale than training would, so logits are far apart and greedy decoding does not hinge
on last-bit float differences between implementations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TINY_CONFIGS = {
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
}
# Benchmark shapes with random weights drawn on the device at load time (loader.random_model):
# only config.json, the tokenizer and random_init.json are written. `synthetic-1b` is
# Llama-3.2-1B's shape with SmolLM2's vocabulary (1.07B parameters), `synthetic-8b`
# Llama-3-8B's (7.4B: the vocabulary is SmolLM2's 49k, not 128k; 14.8 GB in bf16);
# `synthetic-tiny` is the same code path at test size (the CPU dry run of
# scripts/gpu_check.sh).
SYNTHETIC_CONFIGS = {
    "synthetic-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "synthetic-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "synthetic-tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _config(spec: dict, dtype: str = "float32", max_len: int = 2048):
    from transformers import AutoConfig

    spec = dict(spec)
    model_type = spec.pop("model_type")
    rope_theta = spec.pop("rope_theta")
    return AutoConfig.for_model(
        model_type, vocab_size=49152, max_position_embeddings=max_len, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype=dtype,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **spec,
    )


def generate_synthetic(name: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """config.json (architecture LlamaForCausalLM, bf16), tokenizer, random_init.json."""
    config = _config(SYNTHETIC_CONFIGS[name], dtype="bfloat16", max_len=8192)
    config.architectures = ["LlamaForCausalLM"]
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    (out_dir / "random_init.json").write_text(json.dumps({"seed": seed, "std": 0.02}))
    _copy_tokenizer(tokenizer_dir, out_dir)


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for fname in TOKENIZER_FILES:
        if (tokenizer_dir / fname).exists():
            shutil.copy(tokenizer_dir / fname, out_dir / fname)


def generate(name: str, out_dir: Path, tokenizer_dir: Path) -> None:
    """A tiny model; `tokenizer_dir` holds the tokenizer files (a built smollm2-135m)."""
    if name in SYNTHETIC_CONFIGS:
        return generate_synthetic(name, out_dir, tokenizer_dir)
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(TINY_CONFIGS[name])
    gen = torch.Generator().manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    _copy_tokenizer(tokenizer_dir, out_dir)
