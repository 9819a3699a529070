"""The OpenAI-compatible API, driven by the real `openai` client against a live node:
greedy outputs equal the offline engine's for the same token ids; streaming, stop strings,
`usage` (also in streams) and `seed` behave as OpenAI documents them."""

from __future__ import annotations

import openai
import pytest
from server_harness import MODEL

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours, please."}]


def stop_string_for(offline, prompt: str, n_tokens: int = 24) -> tuple[str, str]:
    """A 3-6 character stop string taken from the middle of the greedy output, whose
    first occurrence is where it was taken from. Returns (stop, full greedy text)."""
    full = offline.greedy(prompt, n_tokens)
    text = full.text
    for k in range(5, n_tokens - 4):
        at = len(offline.tokenizer.decode(full.output_ids[:k], skip_special_tokens=True))
        stop = text[at:at + 5].strip()
        if len(stop) >= 3 and text.find(stop) >= at - 1 and text.find(stop) > 0:
            return stop, text
    raise AssertionError(f"no usable stop string in {text!r}")


# -- completions ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_offline_with_usage(client, offline, prompt):
    ref = offline.greedy(offline.encode(prompt), 20)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id
    assert len(r.choices) == 1
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    n_prompt = len(offline.encode(prompt))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(ref.output_ids)
    assert r.usage.total_tokens == n_prompt + len(ref.output_ids)


def test_completion_with_token_id_prompt(client, offline):
    ids = offline.encode(PROMPTS[0]) + [42, 4242]
    ref = offline.greedy(ids, 12)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(ids)


def test_completion_stream_equals_offline(client, offline):
    prompt = PROMPTS[1]
    ref = offline.greedy(prompt, 24)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True))
    assert len(chunks) >= 2  # streamed, not one blob
    assert all(c.usage is None for c in chunks)  # no usage unless asked for
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "length" and not any(reasons[:-1])


def test_completion_stream_include_usage(client, offline):
    prompt = PROMPTS[2]
    ref = offline.greedy(prompt, 10)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == ref.text
    n_prompt = len(offline.encode(prompt))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens,
            last.usage.total_tokens) == (n_prompt, 10, n_prompt + 10)


@pytest.mark.parametrize("as_list", [False, True], ids=["str", "list"])
def test_completion_stop_string(client, offline, as_list):
    """A stop string (given as a plain string, as OpenAI allows, or in a list) ends the
    output just before it; the output equals the offline engine's."""
    prompt = PROMPTS[0]
    stop, full = stop_string_for(offline, prompt)
    expected = full[:full.find(stop)]
    ref = offline.greedy(prompt, 24, stop=[stop])
    assert (ref.text, ref.finish_reason) == (expected, "stop")
    stop_arg = [stop, "\x00never"] if as_list else stop
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  stop=stop_arg)
    assert r.choices[0].text == expected, (stop, full)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ref.output_ids)


@pytest.mark.parametrize("as_list", [False, True], ids=["str", "list"])
def test_completion_stream_stop_string_never_leaks(client, offline, as_list):
    prompt = PROMPTS[0]
    stop, full = stop_string_for(offline, prompt)
    expected = full[:full.find(stop)]
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stop=[stop] if as_list else stop))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == expected, (stop, full, pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_with_unmatched_stop_strings_flushes_everything(client, offline):
    """Held-back characters (a stop string might be starting) are released at the end."""
    prompt = PROMPTS[1]
    ref = offline.greedy(prompt, 16)
    stops = ["\x00this never appears", "\x01nor this"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                            temperature=0, stream=True, stop=stops))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_seed_is_reproducible_and_matches_offline(client, offline):
    prompt = PROMPTS[2]

    def sample(seed):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c  # 16 tokens sampled at T=1 from a 49k vocabulary: never all equal
    ref = offline.greedy(prompt, 16, temperature=1.0, seed=1234)
    assert a == ref.text


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]


# -- chat ---------------------------------------------------------------------------------------
def test_chat_greedy_equals_offline_with_usage(client, offline):
    ids = offline.chat_ids(CHAT)
    ref = offline.greedy(ids, 20)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                       temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == ref.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens,
            r.usage.total_tokens) == (len(ids), 20, len(ids) + 20)


def test_chat_max_completion_tokens(client, offline):
    ref = offline.greedy(offline.chat_ids(CHAT), 7)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=7,
                                       temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == 7


def test_chat_stream_with_usage_equals_offline(client, offline):
    ids = offline.chat_ids(CHAT)
    ref = offline.greedy(ids, 16)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref.text
    assert body[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].finish_reason for c in body[:-1])
    assert last.choices == [] and last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens == len(ids)


def test_chat_content_parts_equal_plain_text(client, offline):
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are a terse "},
                                            {"type": "text", "text": "assistant."}]},
             {"role": "user", "content": [{"type": "text", "text": "Name three colours, "},
                                          {"type": "text", "text": "please."}]}]
    ref = offline.greedy(offline.chat_ids(CHAT), 8)
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(offline.chat_ids(CHAT))


def test_chat_stop_string(client, offline):
    ids = offline.chat_ids(CHAT)
    full = offline.greedy(ids, 24)
    at = len(offline.tokenizer.decode(full.output_ids[:8], skip_special_tokens=True))
    stop = full.text[at:at + 4]
    assert len(stop.strip()) >= 2, full.text
    expected = full.text[:full.text.find(stop)]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                       temperature=0, stop=stop)
    assert r.choices[0].message.content == expected, (stop, full.text)
    assert r.choices[0].finish_reason == "stop"


def test_chat_seed_is_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9, top_p=0.95,
            seed=seed).choices[0].message.content

    a = sample(7)
    assert a == sample(7)
    assert a != sample(8)


def test_openai_client_surfaces_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=17)
    assert "at most 16" in e.value.body["message"]
