"""SGLang-style POST /generate: `text` or `input_ids`, streaming or not. A stream is SSE
`data: {...}` lines, each with the cumulative text/output_ids/meta_info so far, ending with
`data: [DONE]`; the result equals the offline engine's."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_harness import assert_error, sse_events

PROMPT = "The quick brown fox"


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def _stream(server, body: dict) -> tuple[httpx.Response, list]:
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True},
                      timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        lines = list(r.iter_lines())
    return r, sse_events(lines)


def _check_result(obj: dict, ref, n_prompt: int) -> None:
    assert obj["text"] == ref.text
    assert obj["output_ids"] == ref.output_ids
    meta = obj["meta_info"]
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["prompt_tokens"] == n_prompt
    assert meta["completion_tokens"] == len(ref.output_ids)
    assert meta["finish_reason"] == ref.finish_reason
    assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] < n_prompt


@pytest.mark.parametrize("by", ["text", "input_ids"])
def test_generate_non_stream(server, offline, by):
    ids = offline.encode(PROMPT)
    ref = offline.greedy(ids, 12)
    body = {by: PROMPT if by == "text" else ids,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    _check_result(r.json(), ref, len(ids))


@pytest.mark.parametrize("by", ["text", "input_ids"])
def test_generate_stream_is_cumulative_and_ends_with_done(server, offline, by):
    ids = offline.encode(PROMPT) + ([7, 77, 777] if by == "input_ids" else [])
    ref = offline.greedy(ids, 14)
    body = {by: PROMPT if by == "text" else ids,
            "sampling_params": {"max_new_tokens": 14, "temperature": 0}}
    r, events = _stream(server, body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    objs = events[:-1]
    assert len(objs) >= 2  # really streamed
    prev_text, prev_ids = "", []
    rids = {o["meta_info"]["id"] for o in objs}
    assert len(rids) == 1
    for o in objs:
        assert o["text"].startswith(prev_text)  # cumulative
        assert o["output_ids"][:len(prev_ids)] == prev_ids
        assert len(o["output_ids"]) >= len(prev_ids)
        assert o["meta_info"]["completion_tokens"] == len(o["output_ids"])
        prev_text, prev_ids = o["text"], o["output_ids"]
    assert all(o["meta_info"]["finish_reason"] is None for o in objs[:-1])
    _check_result(objs[-1], ref, len(ids))


def test_generate_stream_equals_non_stream_with_stop(server, offline):
    full = offline.greedy(PROMPT, 20)
    at = len(offline.tokenizer.decode(full.output_ids[:6], skip_special_tokens=True))
    stop = full.text[at:at + 4]
    expected = full.text[:full.text.find(stop)]
    sp = {"max_new_tokens": 20, "temperature": 0, "stop": [stop]}
    r = _post(server, {"text": PROMPT, "sampling_params": sp})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == expected
    assert r.json()["meta_info"]["finish_reason"] == "stop"
    _, events = _stream(server, {"text": PROMPT, "sampling_params": sp})
    texts = [e["text"] for e in events[:-1]]
    assert texts[-1] == expected
    assert not any(stop in t for t in texts)


def test_generate_seeded_sampling_is_reproducible(server, offline):
    sp = {"max_new_tokens": 10, "temperature": 0.8, "top_k": 50, "seed": 5}
    a = _post(server, {"text": PROMPT, "sampling_params": sp}).json()
    b = _post(server, {"text": PROMPT, "sampling_params": sp}).json()
    assert a["output_ids"] == b["output_ids"]
    ref = offline.greedy(PROMPT, 10, temperature=0.8, top_k=50, seed=5)
    assert a["output_ids"] == ref.output_ids


def test_generate_rid_is_echoed(server):
    r = _post(server, {"text": PROMPT, "rid": "my-request-1",
                       "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == "my-request-1"
    server.wait_pools_full()


def test_duplicate_rid_is_400_and_leaves_the_original_request_alone(server, offline):
    """A second request under the rid of one still running is refused (400); the running
    one is unaffected: it streams to its end, with the offline engine's output."""
    ids = offline.encode(PROMPT)
    # Long enough to be still running when the duplicate arrives, even on a fast machine
    # (100 tokens of tiny-llama were once done before it).
    ref = offline.greedy(ids, 1000, ignore_eos=True)
    lines: list[str] = []
    errors: list[BaseException] = []

    def original() -> None:
        body = {"rid": "taken", "input_ids": ids, "stream": True, "sampling_params": {
            "max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}}
        try:  # a few seconds of generation; a stalled stream hits the 20 s read timeout
            with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=20) as r:
                lines.extend(ln for ln in r.iter_lines() if ln.strip())
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=original)
    t.start()
    deadline = time.monotonic() + 20
    while len(lines) < 2 and not errors:
        assert time.monotonic() < deadline, "the first request never started"
        time.sleep(0.005)
    dup = _post(server, {"rid": "taken", "text": "intruder",
                         "sampling_params": {"max_new_tokens": 2}})
    t.join(300)  # seconds when idle; a starved 2-core machine has taken over 2 minutes
    assert not t.is_alive(), f"the original request is still streaming ({len(lines)} lines)"
    assert_error(dup, 400, "duplicate")
    assert not errors, errors
    events = sse_events(lines)
    assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2]
    _check_result(events[-2], ref, len(ids))
    server.wait_pools_full(open_requests=True)


def test_server_info_names_the_loop_and_why(server):
    """The automatic loop choice is visible: which loop, why, on what device and dtype, and
    which kernel build."""
    from pdserve.cpus import usable_cores

    eng = server.info()["engine"]
    assert eng["loop"] in ("overlap", "normal") and eng["loop_reason"].startswith("auto: ")
    # On CPU: overlap only with a core to spare beyond the scheduler process's own threads.
    spare = usable_cores() > eng["torch_threads"]
    assert eng["loop"] == ("overlap" if spare else "normal")
    assert eng["dtype"] == "float32" and eng["page_size"] >= 1 and eng["torch_threads"] >= 1
    # The fused kernels' build is named (its cache folder), or None on the torch ops.
    from pdserve.kernels import cache_dir

    assert eng["kernels_build"] == (cache_dir().name if eng["kernels"] == "native" else None)
