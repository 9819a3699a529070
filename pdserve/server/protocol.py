"""Request bodies of the HTTP API (DESIGN §9), validated with pydantic.

Field checks that pydantic cannot express (one prompt only, n == 1, the served model)
live in `validate()` methods and raise `ApiError` with the OpenAI-shaped status.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Every integer that crosses to the scheduler must fit msgpack's 64-bit ints (and torch).
I32 = 1 << 31
Seed = Annotated[int, Field(ge=0, lt=1 << 63)]
TokenId = Annotated[int, Field(ge=0, lt=I32)]


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class SamplingBody(BaseModel):
    """/generate `sampling_params` (SGLang names)."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(128, gt=0, lt=I32)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, lt=I32)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    seed: Seed | None = None


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    stream: bool = False
    rid: str | None = Field(None, max_length=128)
    # Internal fields of the PD legs (DESIGN §2); the router fills them in.
    bootstrap_room: int | None = Field(None, ge=0, lt=1 << 63)
    prefill_node_id: str | None = Field(None, max_length=256)

    def validate_input(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of `text` or `input_ids`")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAICommon(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored
    model: str
    max_tokens: int | None = Field(None, gt=0, lt=I32)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, lt=I32)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    logprobs: int | bool | None = None

    def check_common(self, served: str) -> None:
        if self.model != served:
            raise ApiError(404, f"model {self.model!r} does not exist; this server serves "
                                f"{served!r}", "model_not_found")
        if self.n != 1:
            raise ApiError(400, "only n=1 is supported")
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v


class CompletionBody(_OpenAICommon):
    prompt: str | list[TokenId] | list[str]
    echo: bool = False

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported")
            return p[0]
        if self.echo:
            raise ApiError(400, "echo is not supported")
        return p


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the model's chat template, ready for an answer.
    Template errors come from the client's messages, so they are a 400."""
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    except Exception as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}") from exc
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class ChatBody(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0, lt=I32)
