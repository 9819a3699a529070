"""Request bodies of the HTTP API (docs/architecture.md: Interfaces), validated with pydantic.

Field checks that pydantic cannot express (one prompt only, n == 1, the served model)
live in `validate()` methods and raise `ApiError` with the OpenAI-shaped status.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from pdserve.http.errors import ApiError
from pdserve.http.plain_json import unsafe_reason
from pdserve.http.sglang_body import BootstrapFields, SGLangGenerateFlags
from pdserve.sampling_params import MAX_LOGPROBS

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
NumLogprobs = Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class _PlainJson(BaseModel):
    """Root of every request body: the raw input (extra fields included) must be plain
    JSON, or it could not be forwarded, logged or echoed (see pdserve.http.plain_json)."""

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
    # SGLang's logprob fields (docs/architecture.md: Logprobs). logprob_start_len: first
    # prompt position with input logprobs; -1 = none.
    return_logprob: StrictBool = False
    top_logprobs_num: NumLogprobs = 0
    logprob_start_len: int = Field(-1, strict=True, ge=-1, lt=I32)

    def validate_input(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of `text` or `input_ids`")
        self.check_sglang_flags()
        if not self.return_logprob and (self.top_logprobs_num or self.logprob_start_len >= 0):
            raise ApiError(400, "top_logprobs_num and logprob_start_len need return_logprob")

    def logprob_params(self, n_prompt: int) -> dict:
        """SamplingParams logprob fields of this request."""
        if not self.return_logprob:
            return {}
        wants_prompt = 0 <= self.logprob_start_len < n_prompt
        return {"logprobs": self.top_logprobs_num,
                "prompt_logprobs": self.top_logprobs_num if wants_prompt else None}


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
    n: int = Field(1, strict=True, ge=1, lt=I32)
    ignore_eos: StrictBool = False

    def check_common(self, served: str, max_n: int = 1) -> None:
        if self.model != served:
            raise ApiError(404, f"model {self.model!r} does not exist; this server serves "
                                f"{served!r}", "model_not_found")
        if self.n > max_n:
            raise ApiError(400, f"n must be at most {max_n} on this server (--max-n), "
                                f"got {self.n}")

    def choice_seed(self, index: int) -> int | None:
        """Choice `index` of an n > 1 request samples with seed + index: the choices differ
        from each other, and the same request gives the same choices again."""
        return None if self.seed is None else (self.seed + index) % (1 << 63)

    def top_logprobs_k(self) -> int | None:
        """Alternatives per output token, or None when no logprobs were asked for."""
        return None

    def wants_prompt_logprobs(self) -> bool:
        return False

    def sampling(self, max_tokens: int, index: int = 0) -> dict:
        """SamplingParams fields of choice `index` (the node's and the router's)."""
        return {"max_new_tokens": max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop,
                "stop_token_ids": self.stop_token_ids or [], "ignore_eos": self.ignore_eos,
                "seed": self.choice_seed(index)}

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v


class CompletionBody(_OpenAICommon):
    prompt: str | list[TokenId] | list[str]
    echo: StrictBool = False
    logprobs: NumLogprobs | None = None  # alternatives per token (legacy completions)

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported")
            return p[0]
        return p

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def wants_prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None


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


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True
                    ) -> list[int]:
    """Token ids of `messages` through the model's chat template, ready for an answer.
    Template errors come from the client's messages, so they are a 400."""
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                            add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}") from exc
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class ChatBody(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: StrictBool = False
    top_logprobs: NumLogprobs | None = None

    def check_common(self, served: str, max_n: int = 1) -> None:
        super().check_common(served, max_n)
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true")

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wants_prompt_logprobs(self) -> bool:
        return False


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


class TokenizeBody(_PlainJson):
    """vLLM's /tokenize: a `prompt`, or chat `messages` through the chat template."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of `prompt` or `messages`")


class DetokenizeBody(_PlainJson):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    tokens: list[TokenId]
