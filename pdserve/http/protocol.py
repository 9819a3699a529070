"""Request bodies of the HTTP API (docs/architecture.md: Interfaces), validated with pydantic.

Field checks that pydantic cannot express (n within --max-n, the served model)
live in `validate()` methods and raise `ApiError` with the OpenAI-shaped status.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from pdserve.http.errors import ApiError
from pdserve.http.plain_json import unsafe_reason
from pdserve.http.sglang_body import BootstrapFields, SGLangGenerateFlags
from pdserve.http.tools import ToolPlan, check_choice, tool_schema, with_tools
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
MAX_GRAMMAR = 1 << 16  # characters of a schema, regex or grammar
Penalty = Annotated[float, Field(strict=True, ge=-2, le=2)]  # OpenAI's range
RepetitionPenalty = Annotated[float, Field(strict=True, gt=0, le=10)]
MinP = Annotated[float, Field(strict=True, ge=0, le=1)]
MinTokens = Annotated[int, Field(strict=True, ge=0, lt=I32)]
# OpenAI's logit_bias: token id (as a JSON key) -> bias in [-100, 100], at most 300 entries.
LogitBias = Annotated[dict[str, Annotated[float, Field(strict=True, ge=-100, le=100)]],
                      Field(max_length=300)]
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
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_p: MinP = 0.0
    min_new_tokens: MinTokens = 0
    logit_bias: LogitBias | None = None
    # Structured output (SGLang's fields), at most one; json_schema is a JSON string.
    json_schema: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR)
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR)
    ebnf: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR)
    # Set by pdserve's router on a migrated request's continuation: its prompt ends with
    # this many tokens the request already generated (docs/architecture.md: Router).
    resumed_outputs: int = Field(0, strict=True, ge=0, lt=I32)


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

    def validate_input(self) -> str | list[int]:
        """Check the fields that depend on each other; the prompt (text or token ids)."""
        if self.text is not None and self.input_ids is None:
            prompt: str | list[int] = self.text
        elif self.input_ids is not None and self.text is None:
            prompt = self.input_ids
        else:
            raise ApiError(400, "give exactly one of `text` or `input_ids`")
        self.check_sglang_flags()
        if not self.return_logprob and (self.top_logprobs_num or self.logprob_start_len >= 0):
            raise ApiError(400, "top_logprobs_num and logprob_start_len need return_logprob")
        return prompt

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


# OpenAI fields that are accepted and have no effect here (bookkeeping for OpenAI's own
# platform, or a default that is pdserve's only behaviour). Any other unknown field is a
# 400 naming it: a client that asks for a feature is told, not silently ignored.
IGNORED_OPENAI_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "parallel_tool_calls"})
# SGLang's extensions that its router sends on every OpenAI body, accepted at these values
# (pdserve's only behaviour); another value asks for something pdserve lacks. A null
# unknown field asks for nothing either.
SGLANG_DEFAULTS = {"no_stop_trim": False, "continue_final_message": False,
                   "skip_special_tokens": True, "spaces_between_special_tokens": True,
                   "separate_reasoning": True, "stream_reasoning": True,
                   "return_hidden_states": False}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs `json_schema`")
        return self

    def grammar(self) -> dict:
        """SamplingParams fields: json_object is any JSON object (as OpenAI's JSON mode)."""
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema":
            assert self.json_schema is not None  # a validator requires it for this type
            schema = self.json_schema.schema_ or {}
            text = json.dumps(schema)
            if len(text) > MAX_GRAMMAR:
                raise ApiError(400, f"response_format's schema is over {MAX_GRAMMAR} characters")
            return {"json_schema": text}
        return {}


class _OpenAICommon(_PlainJson, BootstrapFields):
    # extra="allow" only to name an unknown field in our own words (`_known_fields`).
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
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0  # vLLM's and SGLang's extension
    min_p: MinP = 0.0
    min_tokens: MinTokens = 0
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None

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
                "seed": self.choice_seed(index),
                "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty,
                "repetition_penalty": self.repetition_penalty, "min_p": self.min_p,
                "min_new_tokens": self.min_tokens, "logit_bias": self.logit_bias,
                **(self.response_format.grammar() if self.response_format else {})}

    @model_validator(mode="after")
    def _known_fields(self):
        unknown = sorted(k for k, v in (self.model_extra or {}).items()
                         if k not in IGNORED_OPENAI_FIELDS and v is not None
                         and SGLANG_DEFAULTS.get(k, ...) != v)
        if unknown:
            raise ApiError(400, f"unsupported field{'s' if len(unknown) > 1 else ''}: "
                                f"{', '.join(unknown)} (pdserve does not implement "
                                f"{'them' if len(unknown) > 1 else 'it'}; fields accepted "
                                f"and ignored: {', '.join(sorted(IGNORED_OPENAI_FIELDS))})",
                           "unsupported_field")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v


class CompletionBody(_OpenAICommon):
    # OpenAI's four forms: a text, token ids, or a batch of either (each gets n choices).
    # Batched ids are range-checked per prompt (prompt_check), so a 400 names the prompt.
    prompt: str | list[TokenId] | list[str] | list[list[Annotated[int, Field(strict=True)]]]
    # 0 scores the prompt alone (with echo), as OpenAI and vLLM allow: openai_plan.
    max_tokens: Annotated[int, Field(strict=True, ge=0, lt=I32)] | None = None
    echo: StrictBool = False
    logprobs: NumLogprobs | None = None  # alternatives per token (legacy completions)

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the body, in order (a flat list of ids is one prompt)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [cast(str | list[int], p)]
        return cast(list[str | list[int]], list(p))

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def wants_prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None


class FunctionCall(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    name: str = Field(max_length=64)
    arguments: str | dict = "{}"  # OpenAI sends a JSON string


class ToolCall(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    id: str | None = Field(None, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=128)  # a tool message's call
    name: str | None = Field(None, max_length=64)

    def for_template(self) -> dict:
        """The message as chat templates read it: text content; an assistant's calls with
        their arguments as objects (templates print them with `tojson`)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


def _arguments(args: str | dict):
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args)
    except ValueError:
        return args
    return parsed if isinstance(parsed, dict) else args


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` (and `tools`) through the model's chat template, ready for
    an answer. Template errors come from the client's messages, so they are a 400."""
    messages, tools = with_tools(messages, tools or [], tokenizer.chat_template)
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, tools=tools,
                                            add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}") from exc
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class FunctionDef(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    type: Literal["function"]
    function: NamedFunction


class ChatBody(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: StrictBool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def check_common(self, served: str, max_n: int = 1) -> None:
        super().check_common(served, max_n)
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true")
        mode, named = self._tool_mode()
        check_choice(mode, named, self._functions())
        if mode in ("required", "named") and self.response_format is not None and \
                self.response_format.type != "text":
            raise ApiError(400, f"tool_choice {mode!r} and response_format cannot be combined")

    def _functions(self) -> dict[str, dict | None]:
        return {t.function.name: t.function.parameters for t in self.tools or []}

    def _tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function). OpenAI's default
        is "auto" when tools are given, else "none"."""
        c = self.tool_choice
        if isinstance(c, NamedToolChoice):
            return "named", c.function.name
        return (c or ("auto" if self.tools else "none")), None

    def template_tools(self) -> list[dict] | None:
        """The tools for the chat template (none with tool_choice "none", as vLLM)."""
        mode, _ = self._tool_mode()
        return None if mode == "none" or not self.tools else \
            [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_plan(self, parser: str) -> ToolPlan | None:
        mode, named = self._tool_mode()
        if mode == "none" or not self.tools:
            return None
        return ToolPlan(mode, parser, set(self._functions()), named)

    def sampling(self, max_tokens: int, index: int = 0) -> dict:
        sp = super().sampling(max_tokens, index)
        mode, named = self._tool_mode()
        if mode in ("required", "named"):
            sp["json_schema"] = tool_schema(mode, self._functions(), named)
        return sp

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
