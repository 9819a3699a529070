"""`--chat-template FILE` replaces the model's chat template on a node: chat prompts,
/tokenize of messages and the tools fallback all go through the file's template."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_harness import MODEL, Server

TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("template")
    (d / "t.jinja").write_text(TEMPLATE)
    srv = Server("--chat-template", str(d / "t.jinja"), log_dir=d).start()
    try:
        yield srv
    finally:
        srv.stop()


def _prompt_text(url: str, messages: list[dict]) -> str:
    ids = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages},
                     timeout=30).json()["tokens"]
    return httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": ids},
                      timeout=30).json()["prompt"]


def test_the_file_replaces_the_models_template(custom, server):
    msgs = [{"role": "user", "content": "hello there"}]
    assert _prompt_text(custom.url, msgs) == "[USER] hello there\n[ASSISTANT] "
    assert "[USER]" not in _prompt_text(server.url, msgs)  # the default node: the model's
    r = httpx.post(f"{custom.url}/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    n = len(httpx.post(f"{custom.url}/tokenize", json={"model": MODEL, "messages": msgs},
                       timeout=30).json()["tokens"])
    assert r.json()["usage"]["prompt_tokens"] == n
