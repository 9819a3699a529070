"""Request bodies and SSE parsing for the generate / openai / openai-chat backends."""

from __future__ import annotations

from pdserve.loadtest.backends import (
    DONE,
    RequestSpec,
    StreamState,
    build_payload,
    consume,
    error_text,
    parse_sse_line,
)
from pdserve.loadtest.dataset import Prompt

PROMPT = Prompt(3, 8, "a b c", (5, 6, 7))


def test_generate_payload_prefers_ids() -> None:
    body = build_payload(RequestSpec("generate", "m", 0.0, True), PROMPT)
    assert body == {"input_ids": [5, 6, 7], "stream": True,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                        "ignore_eos": True}}
    text_only = build_payload(RequestSpec("generate", "m", 0.0, False), Prompt(3, 8, "a b c"))
    assert text_only["text"] == "a b c" and "input_ids" not in text_only


def test_openai_payloads() -> None:
    body = build_payload(RequestSpec("openai", "m", 0.5, True), PROMPT)
    assert body["prompt"] == "a b c" and body["max_tokens"] == 8 and body["model"] == "m"
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    chat = build_payload(RequestSpec("openai-chat", "m", 0.0, False), PROMPT)
    assert chat["messages"] == [{"role": "user", "content": "a b c"}]
    assert chat["max_completion_tokens"] == 8 and chat["ignore_eos"] is False


def test_json_schema_payloads(tmp_path) -> None:
    import json

    import pytest

    from pdserve.loadtest.config import BenchConfig, ConfigError

    schema = '{"type": "object"}'
    gen = build_payload(RequestSpec("generate", "m", 0.0, True, schema), PROMPT)
    assert gen["sampling_params"]["json_schema"] == schema
    chat = build_payload(RequestSpec("openai-chat", "m", 0.0, True, schema), PROMPT)
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"type": "array", "items": {"type": "integer"}}))
    assert json.loads(BenchConfig(json_schema=str(f)).schema_text())["type"] == "array"
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="--json-schema"):
        BenchConfig(json_schema=str(f)).validate()


def test_parse_sse_line() -> None:
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("") is None and parse_sse_line(": keepalive") is None
    assert "bad SSE data" in parse_sse_line("data: {oops")["error"]


def test_generate_events_are_cumulative() -> None:
    st = StreamState()
    assert not consume("generate", {"text": "", "output_ids": [], "meta_info": {}}, st)
    assert consume("generate", {"text": "Hi", "output_ids": [1],
                                "meta_info": {"prompt_tokens": 4, "completion_tokens": 1}}, st)
    assert consume("generate", {"text": "Hi there", "output_ids": [1, 2, 3],
                                "meta_info": {"completion_tokens": 3, "cached_tokens": 2,
                                              "finish_reason": {"type": "length"}}}, st)
    assert (st.text, st.n_output_ids, st.prompt_tokens, st.completion_tokens) == (
        "Hi there", 3, 4, 3)
    assert st.cached_tokens == 2 and st.finish_reason == "length"
    assert not consume("generate", DONE, st) and st.done


def test_openai_deltas_and_usage() -> None:
    st = StreamState()
    assert consume("openai", {"choices": [{"text": "a", "finish_reason": None}]}, st)
    assert not consume("openai", {"choices": [{"text": "", "finish_reason": "length"}]}, st)
    usage = {"prompt_tokens": 9, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 4}}
    assert not consume("openai", {"choices": [], "usage": usage}, st)
    assert (st.text, st.prompt_tokens, st.completion_tokens, st.cached_tokens) == ("a", 9, 2, 4)
    chat = StreamState()
    assert not consume("openai-chat", {"choices": [{"delta": {"role": "assistant"}}]}, chat)
    assert consume("openai-chat", {"choices": [{"delta": {"content": "x"}}]}, chat)
    assert chat.text == "x"


def test_errors_in_stream_and_bodies() -> None:
    st = StreamState()
    consume("openai", {"error": {"message": "kv cache full", "code": 503}}, st)
    assert st.error == "kv cache full"
    assert error_text({"detail": "Not Found"}) == "Not Found"
    assert error_text({"object": "error", "message": "bad"}) == "bad"


def test_generate_incremental_ids_and_textless_tokens_still_count() -> None:
    st = StreamState()
    # Incremental output_ids (one id per event) with cumulative text.
    assert consume("generate", {"text": "a", "output_ids": [7], "meta_info": {}}, st)
    assert consume("generate", {"text": "ab", "output_ids": [8], "meta_info": {}}, st)
    # A token that decodes to no text yet: only the completion count moves.
    assert consume("generate", {"text": "ab", "output_ids": [9],
                                "meta_info": {"completion_tokens": 3}}, st)
    # A repeated final state (finish reason only) is not a new chunk.
    assert not consume("generate", {"text": "ab", "output_ids": [9],
                                    "meta_info": {"completion_tokens": 3,
                                                  "finish_reason": "length"}}, st)
    assert st.finish_reason == "length"


def test_openai_completions_send_ids_without_text() -> None:
    body = build_payload(RequestSpec("openai", "m", 0.0, True), Prompt(3, 8, None, (5, 6, 7)))
    assert body["prompt"] == [5, 6, 7]
