"""`pdserve.models.tokenizer.load_tokenizer`: for a Llama-type folder whose tokenizer config
names the plain tokenizers-backed class it skips AutoTokenizer (and the torch import behind
it), and the tokenizer it builds behaves exactly like AutoTokenizer's: same class, ids, text,
special tokens and chat prompt. Other folders (a Qwen2 model, whose type transformers maps
to a class of its own; another class named; custom code) go through AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.models.builtin import resolve_model
from pdserve.models.tokenizer import load_tokenizer, names_plain_class

TEXTS = ["Hello world, how are you?", "  leading spaces\tand\ttabs\n\nnew lines",
         "unicode: déjà vu — 東京 🚀", "<|im_start|>user\nspecial tokens inline<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m"])
def test_fast_path_equals_autotokenizer(model: str) -> None:
    path = resolve_model(model)
    assert names_plain_class(path)
    ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.decode(ids) == ref.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == \
                ref.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, len(ours)) == \
        (ref.eos_token_id, ref.bos_token_id, ref.pad_token_id, len(ref))
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_fast_path_does_not_import_torch() -> None:
    path = resolve_model("tiny-llama")
    code = ("import sys; from pdserve.models.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(path)!r}); assert t.encode('hi'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_a_model_type_with_its_own_class_goes_through_autotokenizer() -> None:
    path = resolve_model("tiny-qwen2")  # names the plain class, but is a Qwen2 model
    assert not names_plain_class(path)
    assert type(load_tokenizer(path)) is type(AutoTokenizer.from_pretrained(path))


def test_other_classes_and_custom_code_go_through_autotokenizer(tmp_path: Path) -> None:
    src = resolve_model("tiny-llama")
    folder = tmp_path / "m"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    for changed in ({**cfg, "tokenizer_class": "GPT2Tokenizer"},
                    {**cfg, "auto_map": {"AutoTokenizer": ["x.Tok", None]}}):
        cfg_file.write_text(json.dumps(changed))
        assert not names_plain_class(folder)
    cfg_file.write_text("not json")
    assert not names_plain_class(folder)
    cfg_file.write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    tok = load_tokenizer(folder)  # AutoTokenizer's choice, whatever it is
    assert tok.encode("Hello world") == \
        AutoTokenizer.from_pretrained(folder).encode("Hello world")
