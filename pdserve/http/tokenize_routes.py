"""`POST /tokenize` and `POST /detokenize` in vLLM's request and response shapes, on the
node and the router alike (docs/architecture.md: Interfaces).

    /tokenize   {"prompt": str} | {"messages": [...]}, add_special_tokens (true),
                add_generation_prompt (true), return_token_strs (false)
                -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize {"tokens": [int]} -> {"prompt": str}
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI

from pdserve.http.errors import ApiError
from pdserve.http.protocol import DetokenizeBody, TokenizeBody, chat_prompt_ids

# Tokenizer getter: the node has its tokenizer at once, the router loads it on first use.
TokenizerGetter = Callable[[], Awaitable[Any]]  # a transformers tokenizer


def add_tokenize_routes(app: FastAPI, get_tokenizer: TokenizerGetter,
                        model: Callable[[], str], context: Callable[[], int],
                        vocab: Callable[[], int]) -> None:
    def check_model(name: str | None) -> None:
        if name is not None and name != model():
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{model()!r}", "model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        body.check()
        check_model(body.model)
        tok = await get_tokenizer()
        if body.messages is not None:
            msgs = [x.for_template() for x in body.messages]
            ids = chat_prompt_ids(tok, msgs, body.add_generation_prompt)
        else:
            try:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            except (TypeError, ValueError) as exc:
                raise ApiError(400, f"cannot tokenize the prompt: {exc}") from exc
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": context(), "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        check_model(body.model)
        tok = await get_tokenizer()
        if any(t >= vocab() for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab()})")
        return {"prompt": tok.decode(body.tokens)}
