"""Request bodies of the HTTP API (docs/architecture.md: Interfaces), validated with pydantic.

Field checks that pydantic cannot express (one prompt only, n == 1, the served model)
live in `validate()` methods and raise `ApiError` with the OpenAI-shaped status.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from pdserve.plain_json import unsafe_reason
from pdserve.server.errors import ApiError
from pdserve.server.sglang_body import BootstrapFields, SGLangGenerateFlags

__all__ = ["ApiError"]  # re-exported: callers import it from here

# Every integer that crosses to the scheduler must fit msgpack's 64-bit ints (and torch).
# Integers and booleans are strict, as OpenAI's are: "16", 16.0 or true is no max_tokens,
# "yes" is no `stream`. Floats take ints but never strings, NaN or Infinity.
I32 = 1 << 31
Seed = Annotated[int, Field(strict=True, ge=0, lt=1 << 63)]
TokenId = Annotated[int, Field(strict=True, ge=0, lt=I32)]
Count = Annotated[int, Field(strict=True, gt=0, lt=I32)]
TopK = Annotated[int, Field(strict=True, ge=-1, lt=I32)]
Temperature = Annotated[float, Field(strict=True, ge=0)]
TopP = Annotated[float, Field(strict=True, gt=0, le=1)]
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class _PlainJson(BaseModel):
    """Root of every request body: the raw input (extra fields included) must be plain
    JSON, or it could not be forwarded, logged or echoed (see pdserve.plain_json)."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        if (reason := unsafe_reason(data)) is not None:
            raise ValueError(reason)
        return data


class SamplingBody(BaseModel):
    """/generate `sampling_params` (SGLang names)."""

    model_config = _STRICT
    max_new_tokens: Count = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    seed: Seed | None = None


class GenerateBody(_PlainJson, BootstrapFields, SGLangGenerateFlags):
    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    stream: StrictBool = False
    rid: str | None = Field(None, max_length=128)
    # Internal fields of the PD legs (docs/architecture.md: Request lifecycles); the router fills
    # them in: `bootstrap_room` (BootstrapFields) with `prefill_node_id` (pdserve's router)
    # or with `bootstrap_host` + `bootstrap_port` (SGLang's router).
    prefill_node_id: str | None = Field(None, max_length=256)

    def validate_input(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of `text` or `input_ids`")
        self.check_sglang_flags()


class StreamOptions(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    include_usage: StrictBool = False


class _OpenAICommon(_PlainJson, BootstrapFields):
    # Unknown OpenAI fields are ignored (but must still be plain JSON).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: Count | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, strict=True, ge=1)
    ignore_eos: StrictBool = False
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
    echo: StrictBool = False

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
    model_config = ConfigDict(allow_inf_nan=False)
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
    max_completion_tokens: Count | None = None


def fit_max_tokens(n_prompt: int, requested: int | None, default: int, context: int,
                   truncate: bool) -> int:
    """The completion budget of a request. A default is clipped to the context left after
    the prompt; an explicit budget beyond it is a 400 naming the limit (vLLM and OpenAI
    do the same), unless the server was started with `--truncate-max-tokens`."""
    room = max(1, context - n_prompt)
    if requested is None:
        return min(default, room)
    if n_prompt + requested > context:
        if truncate:
            return room
        raise ApiError(400, f"This model's maximum context length is {context} tokens. "
                            f"However, you requested {n_prompt + requested} tokens "
                            f"({n_prompt} in the prompt, {requested} for the completion). "
                            "Please reduce the prompt or max_tokens.",
                       "context_length_exceeded")
    return requested
