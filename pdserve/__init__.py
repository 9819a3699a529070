"""pdserve: prefill/decode disaggregated LLM serving.

`from pdserve import LLM, SamplingParams` is the offline engine (docs/architecture.md: Interfaces).
Both names
are imported lazily so that light processes (registry, router) do not load torch.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "Output"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM" or name == "Output":
        from pdserve import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
