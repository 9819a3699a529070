"""Small random models (~4M parameters) for fast tests, generated deterministically.

They reuse SmolLM2's tokenizer (a real BPE with a chat template). Weights use a larger
init scale than training would, so logits are far apart and greedy decoding does not hinge
on last-bit float differences between implementations.
"""

from __future__ import annotations

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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def generate(name: str, out_dir: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[name])
    model_type = spec.pop("model_type")
    rope_theta = spec.pop("rope_theta")
    config = AutoConfig.for_model(
        model_type, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **spec,
    )
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
    for fname in TOKENIZER_FILES:
        if (tokenizer_dir / fname).exists():
            shutil.copy(tokenizer_dir / fname, out_dir / fname)
