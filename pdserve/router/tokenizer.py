"""The router tokenizes each request once, exactly as a node would (no special tokens for
plain prompts, the model's chat template for chat), and hands token ids to both legs.

transformers is imported here only (`pdserve.models.tokenizer`: without torch for the
built-in models; the router itself never uses torch). The context length comes from the
model's config.json.
"""

from __future__ import annotations

import json
import logging

from pdserve.http.errors import ApiError
from pdserve.http.protocol import chat_prompt_ids
from pdserve.prompt_check import PromptError, check_prompt_ids

log = logging.getLogger("pdserve.router")
FALLBACK_CONTEXT = 2048  # a config.json without max_position_embeddings


class RouterTokenizer:
    def __init__(self, model: str, cache_dir: str = "", chat_template: str = "",
                 revision: str = "") -> None:
        from pdserve.models.builtin import resolve_model
        from pdserve.models.tokenizer import load_tokenizer, read_chat_template

        # A Hub model: config and tokenizer files only, never the weights.
        path = resolve_model(model, cache_dir, revision=revision, weights=False)
        self.model = model
        self.tok = load_tokenizer(path)
        if chat_template:  # --chat-template: the nodes are given the same file
            self.tok.chat_template = read_chat_template(chat_template)
        config = json.loads((path / "config.json").read_text())
        self.context_length = int(config.get("max_position_embeddings") or FALLBACK_CONTEXT)
        self.vocab_size = int(config.get("vocab_size") or len(self.tok))  # what nodes check
        log.info("tokenizer of %s loaded (context length %d)", model, self.context_length)

    def encode(self, prompt: str | list[int]) -> list[int]:
        try:
            ids = (self.tok.encode(prompt, add_special_tokens=False) if isinstance(prompt, str)
                   else list(prompt))
        except (TypeError, ValueError) as exc:  # the client's text, not our bug
            raise ApiError(400, f"cannot tokenize the prompt: {exc}") from exc
        self.check(ids)
        return ids

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = chat_prompt_ids(self.tok, messages, tools=tools)
        self.check(ids)
        return ids

    def check(self, ids: list[int]) -> None:
        """The checks a node would make, made before any node is bothered."""
        try:
            check_prompt_ids(ids, self.vocab_size, self.context_length)
        except PromptError as exc:
            raise ApiError(400, exc.message, exc.code) from None

    def default_max_tokens(self, ids: list[int]) -> int:
        return max(1, self.context_length - len(ids))
