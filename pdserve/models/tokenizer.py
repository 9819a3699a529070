"""Loading a model folder's tokenizer, cheaply where the folder says which class it is.

`AutoTokenizer.from_pretrained` reads the model's config through `AutoConfig` to pick a
class, and importing that path pulls in torch and much of transformers: ~3 s of CPU in
every process that loads a tokenizer (a node's HTTP process, the router, the scheduler).
AutoTokenizer picks the class from the model type first (Qwen2 folders get
`Qwen2Tokenizer` whatever their tokenizer config says) and from the tokenizer config
otherwise. For a model type it maps to nothing (`PLAIN_MODEL_TYPES`: Llama, so SmolLM2 and
tiny-llama) whose `tokenizer_config.json` names the plain `tokenizers`-backed class, this
builds that class directly: the object AutoTokenizer builds, in ~1 s, without torch
(tests/engine/test_tokenizer_loading.py compares the two for every such built-in model,
so a transformers release that maps Llama to a class of its own fails there). Any other
folder goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

_PLAIN = ("TokenizersBackend", "PreTrainedTokenizerFast")
PLAIN_MODEL_TYPES = ("llama",)  # model types transformers maps to no tokenizer class


def _json(file: Path) -> dict:
    try:
        obj = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def names_plain_class(path: Path) -> bool:
    """True when AutoTokenizer would build the plain class for this folder: a model type
    without a class of its own, the plain class named, no custom code."""
    tok = _json(path / "tokenizer_config.json")
    return (_json(path / "config.json").get("model_type") in PLAIN_MODEL_TYPES
            and tok.get("tokenizer_class") in _PLAIN and "auto_map" not in tok
            and (path / "tokenizer.json").is_file())


def load_tokenizer(path: Path | str):
    """The folder's tokenizer (a transformers tokenizer object)."""
    path = Path(path)
    if names_plain_class(path):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def read_chat_template(path: str) -> str:
    """A `--chat-template` file's Jinja text (ValueError naming the flag when unusable)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template {path!r}: {exc.strerror or exc}") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path!r} is empty")
    return text
