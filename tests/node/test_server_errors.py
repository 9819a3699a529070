"""Client mistakes get their status code and an OpenAI-shaped JSON error
{"error": {"message", "type", "code"}} (never a 500), and the node keeps serving correct
outputs afterwards. (413/429/408 need special flags: see test_server_limits.py.)"""

from __future__ import annotations

import httpx
import pytest
from server_harness import MODEL, assert_error

CONTEXT = 2048  # tiny-llama's max_position_embeddings: the node's default context length
CHAT = [{"role": "user", "content": "hello"}]

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
GENERATE = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
BASES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT_BODY,
         "/generate": GENERATE}


def post(server, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(server.url + path, content=content, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(server.url + path, json=body, timeout=60)


def with_sampling(path: str, **fields) -> dict:
    """The base body of `path` with OpenAI fields (mapped to /generate's names) set."""
    if path != "/generate":
        return {**BASES[path], **fields}
    names = {"max_tokens": "max_new_tokens"}
    sp = {**GENERATE["sampling_params"], **{names.get(k, k): v for k, v in fields.items()}}
    return {**GENERATE, "sampling_params": sp}


@pytest.mark.parametrize("path", list(BASES))
@pytest.mark.parametrize("content", [b"{not json", b'{"model": "tiny-llama", "prompt": "x",',
                                     b"", b"\xff\xfe\x00"], ids=["garbage", "truncated",
                                                                 "empty", "binary"])
def test_invalid_json_is_400(server, path, content):
    assert_error(post(server, path, content=content), 400)


@pytest.mark.parametrize("path", list(BASES))
def test_body_that_is_not_an_object_is_400(server, path):
    assert_error(post(server, path, [1, 2, 3]), 400)
    assert_error(post(server, path, "just a string"), 400)


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard",
                                                            "content": "hi"}]}, "role"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "text"),
    ("/generate", {"text": "a", "input_ids": [1, 2]}, "input_ids"),
])
def test_missing_or_conflicting_fields_are_400(server, path, body, needle):
    assert_error(post(server, path, body), 400, needle)


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "max_tokens", "ten"),
    ("/v1/completions", "prompt", 5),
    ("/v1/completions", "temperature", "hot"),
    ("/v1/completions", "stream", "maybe"),
    ("/v1/completions", "stop", 3),
    ("/v1/chat/completions", "messages", "hello"),
    ("/v1/chat/completions", "top_p", [1]),
    ("/generate", "text", 42),
    ("/generate", "input_ids", ["a", "b"]),
    ("/generate", "sampling_params", "greedy"),
])
def test_wrong_types_are_400(server, path, field, value):
    assert_error(post(server, path, {**BASES[path], field: value}), 400, field)


@pytest.mark.parametrize("path", list(BASES))
def test_unknown_sampling_field_of_generate_is_400(server, path):
    if path == "/generate":
        body = {**GENERATE, "sampling_params": {"max_new_tokens": 2, "temprature": 0}}
        assert_error(post(server, path, body), 400, "temprature")
    else:  # OpenAI bodies ignore unknown fields, like the OpenAI API does
        r = post(server, path, {**BASES[path], "user": "someone", "frequency_penalty": 0})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", list(BASES))
def test_prompt_longer_than_context_is_400_naming_the_limit(server, offline, path):
    words = " hello" * (CONTEXT + 50)
    n = len(offline.encode(words))
    assert n > CONTEXT
    if path == "/v1/completions":
        body = {**COMPLETION, "prompt": words}
    elif path == "/v1/chat/completions":
        body = {**CHAT_BODY, "messages": [{"role": "user", "content": words}]}
    else:
        body = {**GENERATE, "text": words}
    err = assert_error(post(server, path, body), 400, str(CONTEXT))
    assert "context" in err["message"].lower()


def test_prompt_of_exactly_the_context_is_400_and_one_less_is_served(server):
    ids = [100 + i % 1000 for i in range(CONTEXT)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    assert_error(post(server, "/generate", body), 400, str(CONTEXT))
    # One token less leaves room for 1 completion token: asking for 4 is a 400 naming
    # the limit (vLLM's answer), asking for 1 or for the default is served.
    err = assert_error(post(server, "/generate", {**body, "input_ids": ids[:-1]}), 400,
                       str(CONTEXT))
    assert err["code"] == "context_length_exceeded" and "2051" in err["message"]
    for sampling in ({"max_new_tokens": 1, "temperature": 0}, {"temperature": 0}):
        r = post(server, "/generate", {"input_ids": ids[:-1], "sampling_params": sampling})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 1  # capped by the context
        assert r.json()["meta_info"]["finish_reason"] == "length"


@pytest.mark.parametrize("path", list(BASES))
@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_not_positive_is_400(server, path, value):
    name = "max_new_tokens" if path == "/generate" else "max_tokens"
    assert_error(post(server, path, with_sampling(path, max_tokens=value)), 400, name)


def test_max_completion_tokens_not_positive_is_400(server):
    body = {**CHAT_BODY, "max_completion_tokens": 0}
    assert_error(post(server, "/v1/chat/completions", body), 400, "max_completion_tokens")


@pytest.mark.parametrize("path", list(BASES))
def test_negative_temperature_is_400(server, path):
    assert_error(post(server, path, with_sampling(path, temperature=-0.5)), 400, "temperature")


@pytest.mark.parametrize("path", list(BASES))
@pytest.mark.parametrize(("field", "value"), [("top_p", 0), ("top_p", 1.5), ("top_k", -2)])
def test_out_of_range_sampling_is_400(server, path, field, value):
    assert_error(post(server, path, with_sampling(path, **{field: value})), 400, field)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [17, 1000])
def test_n_over_max_n_is_400(server, path, n):
    assert_error(post(server, path, {**BASES[path], "n": n}), 400, "at most 16")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(server, path, stream):
    body = {**BASES[path], "model": "gpt-5", "stream": stream}
    err = assert_error(post(server, path, body), 404, "gpt-5")
    assert MODEL in err["message"]  # says what is served


@pytest.mark.parametrize("path", list(BASES))
def test_streaming_request_errors_are_http_errors_not_in_band(server, path):
    """Validation happens before the stream starts: a bad streaming request is a 400."""
    body = with_sampling(path, temperature=-1)
    body["stream"] = True
    assert_error(post(server, path, body), 400, "temperature")


def test_bad_token_ids_are_400(server):
    for ids in ([], [-1, 5], [10**9]):
        assert_error(post(server, "/generate", {"input_ids": ids}), 400)
    assert_error(post(server, "/v1/completions", {**COMPLETION, "prompt": [10**9]}), 400)
    assert_error(post(server, "/v1/completions", {**COMPLETION, "prompt": ""}), 400, "empty")


def test_mixed_or_too_many_prompts_are_400(server):
    """Several prompts are fine (test_server_batched.py), but not mixed forms or >1024."""
    for prompt in (["one", [1, 2]], [[1, 2], "two"], ["x"] * 1025):
        assert_error(post(server, "/v1/completions", {**COMPLETION, "prompt": prompt}), 400,
                     "prompt")


def test_unknown_route_and_wrong_method_are_openai_shaped(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing-here", timeout=10), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions", timeout=10), 405)


def test_health_is_200(server):
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


HUGE = 2**64  # valid JSON, but no 64-bit integer holds it


@pytest.mark.parametrize(("path", "field"), [
    ("/generate", "seed"), ("/generate", "stop_token_ids"), ("/generate", "max_tokens"),
    ("/generate", "top_k"), ("/v1/completions", "seed"), ("/v1/completions", "max_tokens"),
    ("/v1/chat/completions", "stop_token_ids"), ("/v1/chat/completions", "top_k"),
])
def test_integers_beyond_64_bits_are_400_not_500(server, path, field):
    value = [HUGE] if field == "stop_token_ids" else HUGE
    r = post(server, path, with_sampling(path, **{field: value}))
    assert_error(r, 400)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    server.wait_pools_full(timeout=5, open_requests=True)  # nothing left behind


def test_server_keeps_serving_after_bad_input(server, client, offline):
    """Runs after the error tests above (file order): outputs still exact, pools full."""
    for prompt in ("After the errors", "still fine?"):
        ref = offline.greedy(prompt, 10)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                      temperature=0)
        assert r.choices[0].text == ref.text
    server.wait_pools_full(open_requests=True)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
