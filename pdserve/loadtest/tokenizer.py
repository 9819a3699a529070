"""The bench's tokenizer: token ids for random prompts, text for OpenAI backends, counts.

A folder with `tokenizer.json` is read with the light `tokenizers` library; only folders
without one fall back to transformers' AutoTokenizer (heavy: imported only then). Built-in
model names resolve through `pdserve.models.builtin`, imported lazily for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchTokenizer:
    name: str
    vocab_size: int
    special_ids: frozenset[int]
    backend: Any  # tokenizers.Tokenizer or a transformers tokenizer

    def encode(self, text: str) -> list[int]:
        if hasattr(self.backend, "encode_batch"):  # tokenizers.Tokenizer
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.backend.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def normal_ids(self) -> list[int]:
        """Ids safe for random prompts: every id that is not a special/added token."""
        return [i for i in range(self.vocab_size) if i not in self.special_ids]


def resolve_folder(spec: str, build: bool = True) -> Path:
    """A local folder path or a pdserve built-in model name -> a folder with tokenizer files.

    `build=False` accepts a built-in only when it is already in the user cache: guessing a
    tokenizer from the served model's name must not start a model conversion (torch).
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    from pdserve.models.builtin import BUILTIN, cache_root, resolve_model  # lazy: stays light

    if not build and spec in BUILTIN and not (cache_root() / spec / ".complete").exists():
        raise ValueError(f"built-in model {spec!r} is not in the cache yet")
    return resolve_model(spec, weights=False)  # a Hub name: its tokenizer files only


def load_tokenizer(spec: str, build: bool = True) -> BenchTokenizer:
    """Load the tokenizer named by `spec`; raises ValueError/OSError when it cannot."""
    folder = resolve_folder(spec, build)
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        special = frozenset(tok.get_added_tokens_decoder())
        return BenchTokenizer(spec, tok.get_vocab_size(with_added_tokens=True), special, tok)
    from transformers import AutoTokenizer  # heavy; only for folders without tokenizer.json

    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    return BenchTokenizer(spec, len(hf_tok), frozenset(hf_tok.all_special_ids), hf_tok)


def try_load_tokenizer(specs: list[str]) -> tuple[BenchTokenizer | None, list[str]]:
    """First tokenizer that loads among guessed `specs` (no builds), plus why others did not."""
    problems: list[str] = []
    for spec in specs:
        if not spec:
            continue
        try:
            return load_tokenizer(spec, build=False), problems
        except Exception as exc:  # any failure just means "try the next candidate"
            problems.append(f"{spec}: {exc}")
    return None, problems
