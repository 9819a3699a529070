"""Local HF folders of the Llama family load and decode token-exact against transformers:
Qwen3 (qk-norm), Mistral, Qwen2 with tied embeddings, Llama rope scaling variants and
bias options (issue 2, "Models"). Each model is a small random one written to tmp."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import discard_model, get_llm, greedy, random_prompt, run_ids

from pdserve.models.builtin import resolve_model

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
FAMILIES = {
    "qwen3-qk-norm": dict(model_type="qwen3", head_dim=16, tie_word_embeddings=True),
    "qwen3-attention-bias": dict(model_type="qwen3", head_dim=16, attention_bias=True),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", head_dim=16, sliding_window=4096),
    "llama-head-dim-32": dict(model_type="llama", head_dim=32),
    "llama-rope-llama3": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "llama-rope-linear": dict(model_type="llama", rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "llama-rope-yarn": dict(model_type="llama", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 512}),
    "llama-attention-bias": dict(model_type="llama", attention_bias=True,
                                 tie_word_embeddings=False),
    "llama-mlp-bias": dict(model_type="llama", mlp_bias=True),
}
PROMPTS = [random_prompt(n, seed=1100 + n) for n in (5, 40, 150)]
NEW = 16


def _write_model(name: str, root):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[name])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **BASE, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # wide weights: logits far apart, no near-ties in greedy
        for pname, p in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    model.tie_weights()
    path = root / name
    model.save_pretrained(path)
    tok_dir = resolve_model("tiny-llama")
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / fname, path / fname)
    model.eval()
    model.generation_config.eos_token_id = None
    refs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return path, refs


_PATHS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _discard_tmp_models():
    yield
    for path in _PATHS:
        discard_model(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path):
    path, refs = _write_model(family, tmp_path)
    _PATHS.append(str(path))
    llm = get_llm(str(path), max_total_tokens=4096)
    assert run_ids(llm, PROMPTS, greedy(NEW, ignore_eos=True)) == refs


def test_bfloat16_engine():
    """bf16 weights and KV; the loops and page sizes agree with each other in bf16 too."""
    llm = get_llm("tiny-llama", dtype="bfloat16")
    other = get_llm("tiny-llama", dtype="bfloat16", disable_overlap=True, page_size=1,
                    chunked_prefill_size=64)
    assert llm.engine.kv_pool.k_buffers[0].dtype == torch.bfloat16
    assert next(llm.engine.loaded.model.parameters()).dtype == torch.bfloat16
    prompts = [random_prompt(n, seed=1200 + n) for n in (3, 20, 100)]
    a = run_ids(llm, prompts, greedy(12, ignore_eos=True))
    assert a == run_ids(other, prompts, greedy(12, ignore_eos=True))
    assert all(len(x) == 12 for x in a)
