"""The checks every entry point makes on a prompt's token ids before anything is queued:
the offline engine, a node's HTTP side and the router (docs/architecture.md: Interfaces).
One function, one set of messages; each caller turns `PromptError` into its own error type
(ValueError is its base, so the offline API raises it as is; HTTP answers 400 with `code`).
"""

from __future__ import annotations


class PromptError(ValueError):
    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def check_prompt_ids(ids: list[int], vocab_size: int, context_length: int) -> None:
    """Raise PromptError for an empty prompt, an id outside the vocabulary, or a prompt that
    leaves no room for one output token in the context."""
    if not ids:
        raise PromptError("the prompt is empty")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in ids):
        raise PromptError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(ids) >= context_length:
        raise PromptError(f"the prompt has {len(ids)} tokens but this model's context length "
                          f"is {context_length} tokens (prompt + output)",
                          "context_length_exceeded")
