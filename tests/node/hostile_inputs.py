"""Hostile request bodies, as raw JSON text (httpx's encoder refuses to produce NaN,
Infinity and lone surrogates, but a client can send them). Shared by the node tests
(test_server_hostile.py) and the router tests (tests/router/test_router_hostile.py): each
case must get an OpenAI-shaped 400 at once, never a hang, a 500 or a dropped connection.
"""

from __future__ import annotations

import json

import httpx
from server_harness import MODEL

BOUND_S = 60.0  # generous (loaded machine); before the fix some cases hung for 600 s

CONTEXT = 2048  # tiny-llama's context length
SUR = "\\ud800"  # a lone surrogate, as JSON escapes it


def _raw(base: dict, **fields: str) -> bytes:
    """`base` with `fields` set to raw JSON text (inserted verbatim)."""
    parts = [json.dumps(base)[1:-1]] if base else []
    parts += [f'"{name}": {raw}' for name, raw in fields.items()]
    return ("{" + ", ".join(parts) + "}").encode()


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "max_tokens": 2, "temperature": 0}
GENERATE = {"text": "hello"}

# (id, path, raw body, needle expected in the error message)
CASES: list[tuple[str, str, bytes, str]] = [
    ("temp-1e309", "/v1/completions", _raw({**COMPLETION}, top_k="-1", temperature="1e309"),
     "finite"),
    ("temp-inf", "/v1/completions", _raw(COMPLETION, temperature="Infinity"), "finite"),
    ("top_p-nan", "/v1/completions", _raw(COMPLETION, top_p="NaN"), "finite"),
    ("stop-surrogate", "/v1/completions", _raw(COMPLETION, stop=f'"{SUR}"'), "surrogate"),
    ("stop-list-surrogate", "/v1/completions", _raw(COMPLETION, stop=f'["a", "{SUR}"]'),
     "surrogate"),
    ("prompt-surrogate", "/v1/completions",
     _raw({k: v for k, v in COMPLETION.items() if k != "prompt"}, prompt=f'"a{SUR}b"'),
     "surrogate"),
    ("model-surrogate", "/v1/completions",
     _raw({k: v for k, v in COMPLETION.items() if k != "model"}, model=f'"m{SUR}"'),
     "surrogate"),
    ("user-surrogate", "/v1/completions", _raw(COMPLETION, user=f'"{SUR}"'), "surrogate"),
    ("extra-nested", "/v1/completions", _raw(COMPLETION, metadata=f'{{"k": ["{SUR}"]}}'),
     "surrogate"),
    ("extra-inf", "/v1/completions", _raw(COMPLETION, frequency_penalty="-Infinity"),
     "finite"),
    ("stream-yes", "/v1/completions", _raw(COMPLETION, stream='"yes"'), "stream"),
    ("stream-1", "/v1/completions", _raw(COMPLETION, stream="1"), "stream"),
    ("max_tokens-str", "/v1/completions",
     _raw({k: v for k, v in COMPLETION.items() if k != "max_tokens"}, max_tokens='"16"'),
     "max_tokens"),
    ("max_tokens-1e9", "/v1/completions",
     _raw({k: v for k, v in COMPLETION.items() if k != "max_tokens"}, max_tokens="1e9"),
     "max_tokens"),
    ("max_tokens-overflow", "/v1/completions",
     _raw({k: v for k, v in COMPLETION.items() if k != "max_tokens"}, max_tokens="100000"),
     str(CONTEXT)),
    ("chat-content-surrogate", "/v1/chat/completions",
     _raw(CHAT, messages=f'[{{"role": "user", "content": "hi{SUR}"}}]'), "surrogate"),
    ("chat-name-surrogate", "/v1/chat/completions",
     _raw(CHAT, messages=f'[{{"role": "user", "content": "hi", "name": "{SUR}"}}]'),
     "surrogate"),
    ("chat-part-surrogate", "/v1/chat/completions",
     _raw(CHAT, messages=f'[{{"role": "user", "content": [{{"type": "text", '
                         f'"text": "{SUR}"}}]}}]'), "surrogate"),
    ("chat-temp-nan", "/v1/chat/completions",
     _raw(CHAT, messages='[{"role": "user", "content": "hi"}]', temperature="NaN"), "finite"),
    ("chat-overflow", "/v1/chat/completions",
     _raw({**CHAT, "max_tokens": 5000}, messages='[{"role": "user", "content": "hi"}]'),
     str(CONTEXT)),
    ("generate-text-surrogate", "/generate", _raw({}, text=f'"x{SUR}"'), "surrogate"),
    ("generate-temp-inf", "/generate", _raw(GENERATE, sampling_params='{"temperature": '
                                                                      'Infinity}'), "finite"),
    ("generate-top_p-1e999", "/generate", _raw(GENERATE, sampling_params='{"top_p": 1e999}'),
     "finite"),
    ("generate-stop-surrogate", "/generate",
     _raw(GENERATE, sampling_params=f'{{"stop": ["{SUR}"]}}'), "surrogate"),
    ("generate-stream-yes", "/generate", _raw(GENERATE, stream='"yes"'), "stream"),
    ("generate-max-1e9", "/generate", _raw(GENERATE, sampling_params='{"max_new_tokens": 1e9}'),
     "max_new_tokens"),
    ("generate-overflow", "/generate",
     _raw(GENERATE, sampling_params='{"max_new_tokens": 4096}'), str(CONTEXT)),
    ("generate-rid-surrogate", "/generate", _raw(GENERATE, rid=f'"{SUR}"'), "surrogate"),
]
IDS = [c[0] for c in CASES]


def post_raw(base_url: str, path: str, raw: str | bytes) -> httpx.Response:
    """POST a raw JSON body as it is (no re-encoding), answered within BOUND_S."""
    return httpx.post(f"{base_url}{path}", content=raw, timeout=BOUND_S,
                      headers={"content-type": "application/json"})


def post_all_then_generate(base_url: str) -> httpx.Response:
    """Send every hostile case, then one ordinary 3-token /generate; returns its answer."""
    for _, path, raw, _ in CASES:
        post_raw(base_url, path, raw)
    return httpx.post(f"{base_url}/generate", timeout=BOUND_S, json={
        "text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
