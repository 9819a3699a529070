"""Fixtures for the bench tests: the fake streaming server and a tiny word-level tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_fake_server import FakeServer


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tokenizer.json: 300 words w0..w299 plus two special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1} | {f"w{i}": i + 2 for i in range(300)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]", "<eos>"])
    folder = tmp_path_factory.mktemp("tiny_tok")
    tok.save(str(folder / "tokenizer.json"))
    return folder
