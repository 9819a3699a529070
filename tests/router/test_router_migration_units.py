"""Migration's pure parts with the real tiny-llama tokenizer: the continuation's prompt and
sampling, which failures count as a decode death, and the stitcher that turns the
continuation's events into the original request's (ids, text, stop strings across the
migration point)."""

from __future__ import annotations

import pytest
from test_router_units import state
from transformers import AutoTokenizer

from pdserve.http.detokenizer import IncrementalDetokenizer
from pdserve.models.builtin import resolve_model
from pdserve.router.events import Event, StreamFormatError
from pdserve.router.legs import LegError
from pdserve.router.migration import Stitcher, continuation, is_decode_death

TEXT = "Hello wörld, ünïcode ✓ and more words after it"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model("tiny-llama", ""))


def _event(ids: list[int], text: str = "", finish: str | None = None,
           prompt_tokens: int = 5) -> Event:
    return Event("r", "", text, ids, prompt_tokens, 0, finish, {})


def test_continuation_moves_sent_tokens_into_the_prompt():
    sent = _event([11, 12, 13])
    ids, sp = continuation([1, 2], {"max_new_tokens": 10, "temperature": 0, "seed": None},
                           sent)
    assert ids == [1, 2, 11, 12, 13] and sp["max_new_tokens"] == 7 and sp["seed"] is None
    _, seeded = continuation([1], {"max_new_tokens": 10, "seed": 5}, sent)
    _, seeded2 = continuation([1], {"max_new_tokens": 10, "seed": 5}, sent)
    assert seeded["seed"] == seeded2["seed"] != 5  # reproducible for one failure point
    # The grammar and penalties of the continuation count the sent tokens as output. A
    # second migration starts again from the original request with every token sent.
    assert sp["resumed_outputs"] == 3
    _, again = continuation([1, 2], {"max_new_tokens": 10}, _event([11, 12, 13, 14]))
    assert again["resumed_outputs"] == 4


def test_only_the_decode_nodes_own_server_failures_migrate():
    d, p = state("d0", "decode"), state("p0")
    assert is_decode_death(LegError(d, "decode", 503, "connection lost"), "d0")
    assert is_decode_death(StreamFormatError("garbage"), "d0")
    assert not is_decode_death(LegError(d, "decode", 400, "bad request"), "d0")
    assert not is_decode_death(LegError(p, "prefill", 503, "prefill lost"), "d0")
    assert not is_decode_death(LegError(d, "decode", 503, "other node"), "d9")
    assert not is_decode_death(ValueError("bug"), "d0")


@pytest.mark.parametrize("cut", [1, 3, 5, 8])
def test_stitched_text_equals_one_nodes_text(tok, cut: int):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 8
    # The client saw ids[:cut] from the first node (incomplete UTF-8 held back).
    seen = IncrementalDetokenizer(tok)
    for t in ids[:cut]:
        seen.add([t], finished=False)
    s = Stitcher(_event(ids[:cut], seen.emitted, prompt_tokens=7), tok)
    rest, shown = ids[cut:], seen.emitted
    for j in range(1, len(rest) + 1):
        finish = "length" if j == len(rest) else None
        ev = s.stitch(_event(rest[:j], "ignored", finish, prompt_tokens=99))
        assert ev.output_ids == ids[:cut + j] and ev.prompt_tokens == 7
        assert ev.text == shown + ev.delta  # deltas add up
        shown = ev.text
    assert shown == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert ev.finish_reason == "length" and ev.meta["migrated"]


def test_a_stop_string_across_the_migration_point_ends_the_request(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    text_before = tok.decode(ids[:4], skip_special_tokens=True)
    stop = text_before[-2:] + tok.decode(ids[4:6], skip_special_tokens=True)[:2]
    assert stop in TEXT
    s = Stitcher(_event(ids[:4], text_before[:-2]), tok, [stop])  # held back: 2 chars
    finished = None
    for j in range(1, len(ids) - 3):
        ev = s.stitch(_event(ids[4:4 + j]))
        if ev.finish_reason:
            finished = ev
            break
    assert finished is not None and finished.finish_reason == "stop"
    assert stop not in finished.text and TEXT.startswith(finished.text)
    assert finished.text == TEXT[:TEXT.index(stop)]
