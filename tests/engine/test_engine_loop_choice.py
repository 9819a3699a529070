"""The automatic choice between the overlap and the normal loop, and that it is visible."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import get_llm, greedy

from pdserve.config import EngineConfig
from pdserve.engine import loop_choice
from pdserve.engine.loop_choice import choose_loop
from pdserve.engine.loops import NormalLoop, OverlapLoop


def test_explicit_loops_are_kept():
    cpu = torch.device("cpu")
    assert choose_loop("overlap", cpu).loop == "overlap"
    assert choose_loop("normal", cpu).loop == "normal"
    assert choose_loop("normal", torch.device("cuda")).loop == "normal"


def test_auto_overlaps_on_a_gpu():
    choice = choose_loop("auto", torch.device("cuda"))
    assert choice.overlap and "cuda" in choice.reason


@pytest.mark.parametrize("cores,threads,loop", [(2, 2, "normal"), (1, 1, "normal"),
                                                (4, 2, "overlap"), (16, 8, "overlap")])
def test_auto_on_cpu_needs_a_core_beyond_the_forward_threads(monkeypatch, cores, threads,
                                                             loop):
    monkeypatch.setattr(loop_choice, "usable_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    choice = choose_loop("auto", torch.device("cpu"))
    assert choice.loop == loop
    assert f"{cores} cores" in choice.reason


def test_disable_overlap_wins_and_bad_loop_is_refused():
    assert EngineConfig(loop="overlap", disable_overlap=True).requested_loop == "normal"
    with pytest.raises(ValueError, match="loop must be"):
        EngineConfig(loop="fast")
    with pytest.raises(ValueError, match="loop must be"):
        choose_loop("fast", torch.device("cpu"))


def test_engine_runs_the_chosen_loop_and_reports_it():
    auto = get_llm("tiny-llama", loop="auto")
    expected = choose_loop("auto", auto.engine.device)
    loop_cls = OverlapLoop if expected.overlap else NormalLoop
    assert isinstance(auto.engine.loop, loop_cls)
    info = auto.engine.describe()
    assert info["loop"] == expected.loop and info["loop_reason"] == expected.reason
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    forced = get_llm("tiny-llama", loop="normal")
    assert isinstance(forced.engine.loop, NormalLoop)
    ids = [[5, 6, 7, 8, 9] * 3]
    assert (auto.generate(ids, greedy(8))[0].output_ids
            == forced.generate(ids, greedy(8))[0].output_ids)
