"""The fields SGLang's router adds to a request body (docs/architecture.md: Interfaces,
"Behind SGLang's router").

SGLang's router (`sglang-router --pd-disaggregation`) forwards the client's body to a
prefill and a decode worker at once, with `bootstrap_host` / `bootstrap_port` (the
prefill's bootstrap endpoint, see `pdserve/node/sglang_bootstrap.py`) and a random
`bootstrap_room` added. It also fills in SGLang's own /generate defaults (`model: null`,
`log_metrics: true`, ...). Those are accepted here: harmless ones are ignored, and the
ones that ask for a feature pdserve lacks are a 400 only when set to true.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictBool, model_validator

from pdserve.http.errors import ApiError

# Fields of the two PD legs, carried from the body to the node's role (extra fields).
LEG_FIELDS = ("bootstrap_room", "prefill_node_id", "bootstrap_host", "bootstrap_port",
              "decode_tp_size")
# SGLang /generate flags whose true value asks for something pdserve does not produce.
# (`return_logprob` is supported: GenerateBody declares it with its companions.)
UNSUPPORTED_FLAGS = ("return_hidden_states", "return_entropy", "return_bytes", "background")
BATCHED = ("batched requests are not supported: send one prompt per request "
           "(a list of prompts, input_ids or bootstrap rooms was given)")


def is_batched(data: Any) -> bool:
    """A batched SGLang body: a list body, a list of texts, a list of id lists, lists of
    bootstrap rooms/hosts/ports (what SGLang's router sends for a batch), or a PD leg
    (leg fields given) whose completions `prompt` is a list of prompts. Client-facing
    completions take several prompts (pdserve/http/openai_plan.py); one leg cannot."""
    if isinstance(data, list):
        return True
    if not isinstance(data, dict):
        return False
    ids = data.get("input_ids")
    prompt = data.get("prompt")
    several = isinstance(prompt, list) and (any(isinstance(p, list) for p in prompt) or (
        len(prompt) > 1 and isinstance(prompt[0], str)))
    return (isinstance(data.get("text"), list)
            or (several and any(data.get(k) is not None for k in LEG_FIELDS))
            or (isinstance(ids, list) and any(isinstance(x, list) for x in ids))
            or any(isinstance(data.get(k), list) for k in LEG_FIELDS))


class BootstrapFields(BaseModel):
    """Where a decode node finds the prefill of its request, SGLang style."""

    bootstrap_room: int | None = Field(None, strict=True, ge=0, lt=1 << 63)
    bootstrap_host: str | None = Field(None, min_length=1, max_length=255)
    bootstrap_port: int | None = Field(None, strict=True, ge=1, lt=65536)
    # pdserve's router, prefill leg: the decode node's TP size when it differs from the
    # prefill's (KV sliced by heads; docs/architecture.md: Tensor parallelism).
    decode_tp_size: int | None = Field(None, strict=True, ge=1, le=1024)

    @model_validator(mode="before")
    @classmethod
    def _not_batched(cls, data: Any) -> Any:
        if is_batched(data):
            raise ApiError(400, BATCHED, "batch_not_supported")
        return data

    def leg_fields(self) -> dict:
        """The PD leg fields that were given (they go to the node's role)."""
        return {k: v for k in LEG_FIELDS if (v := getattr(self, k, None)) is not None}


class SGLangGenerateFlags(BaseModel):
    """SGLang /generate fields its router always sends; see the module docstring."""

    model: str | None = Field(None, max_length=256)
    log_metrics: StrictBool | None = None
    no_logs: StrictBool | None = None
    return_text_in_logprobs: StrictBool | None = None
    return_logprob: StrictBool | None = None
    return_hidden_states: StrictBool | None = None
    return_entropy: StrictBool | None = None
    return_bytes: StrictBool | None = None
    background: StrictBool | None = None

    def check_sglang_flags(self) -> None:
        wanted = [k for k in UNSUPPORTED_FLAGS if getattr(self, k)]
        if wanted:
            raise ApiError(400, f"not supported by pdserve: {', '.join(wanted)}")
