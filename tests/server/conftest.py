"""Fixtures of the node-server tests: one live `pdserve serve` on tiny-llama shared by the
session (machinery in server_harness.py), and the offline engine as the reference."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from server_harness import MODEL, Server

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default node, shared by every test that does not need special flags. Its
    teardown is itself a check: SIGTERM exits 0 and leaves no child process behind."""
    srv = Server(log_dir=tmp_path_factory.mktemp("server")).start()
    try:
        yield srv
        rc = srv.terminate()
        orphans = srv.orphans()
        assert rc == 0 and not orphans, (rc, orphans, srv.log()[-3000:])
        assert not srv.leftover_files(), srv.leftover_files()
        assert "Traceback" not in srv.log(), srv.log()[-6000:]
    finally:
        srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


class Offline:
    """The offline engine with the server's defaults: what a greedy request must produce."""

    def __init__(self) -> None:
        torch.set_num_threads(1)  # leave the other core to the server under test
        self.llm = LLM(MODEL)
        self.tokenizer = self.llm.tokenizer

    def encode(self, text: str) -> list[int]:
        """How the server encodes a completion prompt / a /generate text."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """How the server encodes a chat request."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def generate(self, prompts: list, **params):
        params.setdefault("temperature", 0.0)
        return self.llm.generate(prompts, SamplingParams(**params))

    def greedy(self, prompt, max_new_tokens: int, **params):
        return self.generate([prompt], max_new_tokens=max_new_tokens, **params)[0]


@pytest.fixture(scope="session")
def offline() -> Iterator[Offline]:
    ref = Offline()
    yield ref
    ref.llm.close()
