"""The overlap loop is genuinely overlapped (docs/architecture.md: Overlap scheduling): result N-1
is processed after
batch N is launched, decode inputs are FutureMap placeholders resolved on the device, both
staging buffers alternate behind a write-after-read guard, and every batch that is not
overlapped is counted by reason. Plus the engine-level API (step, abort)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_helpers import get_llm, greedy, random_prompt, run_bounded, run_ids

from pdserve.engine.staging import StagingRing

DECODE_PROMPTS = [random_prompt(n, seed=600 + n) for n in (5, 12, 30, 47)]
DECODE_TOKENS = 64


class Probe:
    """Records launches, result processing, staging buffers and placeholder inputs."""

    def __init__(self, llm, monkeypatch) -> None:
        eng = llm.engine
        self.events: list[tuple[str, int, str]] = []
        self.buffers: list[object] = []
        self.negatives: list[int] = []  # placeholders per resolved batch
        launch, process = eng.executor.launch, eng.out.process
        pack, resolve = eng.staging.pack, eng.future_map.resolve

        def on_launch(batch):
            self.events.append(("launch", batch.seq, batch.kind))
            return launch(batch)

        def on_process(batch, handle):
            self.events.append(("process", batch.seq, batch.kind))
            return process(batch, handle)

        def on_pack(ints, floats):
            packed = pack(ints, floats)
            self.buffers.append(packed.buf)
            return packed

        def on_resolve(input_ids):
            self.negatives.append(int((input_ids < 0).sum()))
            return resolve(input_ids)

        monkeypatch.setattr(eng.executor, "launch", on_launch)
        monkeypatch.setattr(eng.out, "process", on_process)
        monkeypatch.setattr(eng.staging, "pack", on_pack)
        monkeypatch.setattr(eng.future_map, "resolve", on_resolve)

    def launched_before_processed(self) -> list[bool]:
        """For each processed decode batch s: was batch s+1 launched before s was processed?"""
        order = {ev[:2]: i for i, ev in enumerate(self.events)}
        out = []
        for kind, seq, bkind in self.events:
            if kind == "process" and bkind == "decode" and ("launch", seq + 1) in order:
                out.append(order[("launch", seq + 1)] < order[("process", seq)])
        return out


@pytest.fixture(scope="module")
def normal_ref():
    return run_ids(get_llm("tiny-llama", disable_overlap=True), DECODE_PROMPTS,
                   greedy(DECODE_TOKENS, ignore_eos=True))


def test_overlap_decode_is_pipelined(monkeypatch, normal_ref):
    llm = get_llm("tiny-llama")
    loop = llm.engine.loop
    loop.max_depth = 0
    disabled_before = sum(loop.stats.overlap_disabled.values())
    probe = Probe(llm, monkeypatch)
    outs = run_ids(llm, DECODE_PROMPTS, greedy(DECODE_TOKENS, ignore_eos=True))
    assert outs == normal_ref

    assert loop.max_depth == 2
    # Steady decode: every decode result is processed only after the next batch launched.
    pipelined = probe.launched_before_processed()
    assert len(pipelined) >= DECODE_TOKENS - 3
    assert all(pipelined)
    assert sum(loop.stats.overlap_disabled.values()) == disabled_before  # nothing skipped
    # Decode inputs were FutureMap placeholders: the CPU never waited for the tokens.
    decode_batches = sum(1 for e in probe.events if e[0] == "launch" and e[2] == "decode")
    with_placeholders = sum(1 for n in probe.negatives if n == len(DECODE_PROMPTS))
    assert with_placeholders >= decode_batches - 2
    # Both staging buffers were used, alternately, and both are free again.
    ring = llm.engine.staging
    assert {id(b) for b in probe.buffers} == {id(b) for b in ring.buffers}
    assert all(a is not b for a, b in zip(probe.buffers, probe.buffers[1:], strict=False))
    assert all(b.consumed.is_set() for b in ring.buffers)


def test_normal_loop_is_sequential(monkeypatch, normal_ref):
    llm = get_llm("tiny-llama", disable_overlap=True)
    probe = Probe(llm, monkeypatch)
    assert run_ids(llm, DECODE_PROMPTS, greedy(DECODE_TOKENS, ignore_eos=True)) == normal_ref
    pipelined = probe.launched_before_processed()
    assert pipelined and not any(pipelined)
    assert sum(probe.negatives) == 0  # every input token is known when a batch is built


def test_overlap_forward_runs_on_its_own_thread(monkeypatch):
    llm = get_llm("tiny-llama")
    runner = llm.engine.executor.runner
    threads = set()
    run = runner.run

    def on_run(batch):
        threads.add(threading.current_thread().name)
        return run(batch)

    monkeypatch.setattr(runner, "run", on_run)
    llm.generate([DECODE_PROMPTS[0]], greedy(4))
    assert threads == {"pdserve-forward"}


def test_retraction_disables_overlap_for_that_batch():
    llm = get_llm("tiny-llama", page_size=4, max_total_tokens=256, decode_reserve_tokens=0)
    stats, sched = llm.engine.loop.stats, llm.engine.sched
    before, retr_before = stats.overlap_disabled["retract"], sched.num_retractions
    prompts = [random_prompt(10 + 3 * i, seed=700 + i) for i in range(10)]
    outs = [r.output_ids for r in run_bounded(llm, prompts, greedy(40, ignore_eos=True))]
    assert sched.num_retractions > retr_before
    assert stats.overlap_disabled["retract"] > before
    assert outs == run_ids(get_llm("tiny-llama"), prompts, greedy(40, ignore_eos=True))


def test_consecutive_prefill_sync_policy_is_counted(monkeypatch):
    llm = get_llm("tiny-llama", chunked_prefill_size=64, consecutive_prefill="sync")
    stats = llm.engine.loop.stats
    before = stats.overlap_disabled["consecutive_prefill"]
    probe = Probe(llm, monkeypatch)
    run_ids(llm, [random_prompt(300, seed=9)], greedy(4))  # 5 chunks back to back
    assert stats.overlap_disabled["consecutive_prefill"] - before >= 4
    order = {ev[:2]: i for i, ev in enumerate(probe.events)}
    extends = [seq for kind, seq, bkind in probe.events if kind == "launch" and bkind == "extend"]
    for n in extends[:-1]:  # each prefill result is processed before the next one launches
        assert order[("process", n)] < order[("launch", n + 1)]


def test_consecutive_prefill_overlap_policy_pipelines_chunks(monkeypatch):
    llm = get_llm("tiny-llama", chunked_prefill_size=64, consecutive_prefill="overlap")
    stats = llm.engine.loop.stats
    probe = Probe(llm, monkeypatch)
    prompt = random_prompt(300, seed=9)
    assert run_ids(llm, [prompt], greedy(4)) == run_ids(
        get_llm("tiny-llama", disable_overlap=True), [prompt], greedy(4))
    assert "consecutive_prefill" not in stats.overlap_disabled
    order = {ev[:2]: i for i, ev in enumerate(probe.events)}
    extends = [seq for kind, seq, bkind in probe.events if kind == "launch" and bkind == "extend"]
    assert len(extends) == 5
    for n in extends[:-1]:  # prefill N's result is processed while N+1 runs
        assert order[("launch", n + 1)] < order[("process", n)]


def test_consecutive_prefill_policy_is_validated():
    from pdserve.config import EngineConfig

    with pytest.raises(ValueError, match="consecutive_prefill"):
        EngineConfig(consecutive_prefill="sometimes")


# -- the staging ring's write-after-read guard (no model) -----------------------------------


def _ints(v: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.full((4,), v, dtype=torch.int64)}


def test_staging_ring_waits_for_the_forward_to_copy_inputs():
    ring = StagingRing(torch.device("cpu"))
    first = ring.pack(_ints(1), {})
    second = ring.pack(_ints(2), {})
    assert first.buf is not second.buf
    third = []
    t = threading.Thread(target=lambda: third.append(ring.pack(_ints(3), {})))
    t.start()
    # The third pack reaches the guard (counted just before it blocks) within a generous
    # deadline; it must then still be blocked: buffer 0 holds the first batch's inputs.
    deadline = time.monotonic() + 30
    while ring.guard_waits == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring.guard_waits == 1
    t.join(timeout=0.2)  # a pack that ignored the guard would be done by now
    assert t.is_alive() and not third
    dev = first.to_device(torch.device("cpu"))  # the forward copied them: buffer released
    t.join(timeout=30)
    assert not t.is_alive()
    assert third[0].buf is first.buf
    assert dev["input_ids"].tolist() == [1, 1, 1, 1]  # the copy is unaffected by reuse
    assert second.to_device(torch.device("cpu"))["input_ids"].tolist() == [2, 2, 2, 2]
    assert third[0].to_device(torch.device("cpu"))["input_ids"].tolist() == [3, 3, 3, 3]


def test_staging_ring_grows_buffers():
    ring = StagingRing(torch.device("cpu"))
    big = {"kv_pages": torch.arange(40000, dtype=torch.int64).view(200, 200)}
    packed = ring.pack(big, {"temperature": torch.ones(3000)})
    out = packed.to_device(torch.device("cpu"))
    assert torch.equal(out["kv_pages"], big["kv_pages"])
    assert out["temperature"].shape == (3000,)


# -- engine API: step / abort ---------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_abort_running_request_alone(overlap):
    """The aborted request is reported finished by the engine and frees everything."""
    eng = get_llm("tiny-llama", disable_overlap=not overlap).engine
    req = eng.add_request("abort-running", random_prompt(30, seed=1),
                          greedy(50, ignore_eos=True))
    done = []
    for _ in range(4):
        done += eng.step()
    assert not done and req.output_ids
    assert eng.abort("abort-running")
    assert not eng.abort("abort-running")  # already finished
    done += eng.run_until_idle()
    assert [r.rid for r in done] == ["abort-running"]
    assert req.finish_reason == "abort"
    assert "abort-running" not in eng.requests
    assert eng.pools_full()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_abort_waiting_request(overlap):
    eng = get_llm("tiny-llama", disable_overlap=not overlap).engine
    eng.add_request("abort-waiting", random_prompt(30, seed=2), greedy(50))
    assert eng.abort("abort-waiting")
    done = eng.run_until_idle()
    assert [r.rid for r in done] == ["abort-waiting"]
    assert "abort-waiting" not in eng.requests
    assert eng.pools_full()


def test_abort_one_of_many_leaves_the_others_exact():
    llm = get_llm("tiny-llama")
    eng = llm.engine
    prompts = [random_prompt(n, seed=800 + n) for n in (8, 20, 33)]
    ref = run_ids(llm, prompts, greedy(30, ignore_eos=True))
    for i, p in enumerate(prompts):
        eng.add_request(f"many-{i}", p, greedy(30, ignore_eos=True))
    done = []
    for _ in range(6):
        done += eng.step()
    eng.abort("many-1")
    done += eng.run_until_idle()
    by_rid = {r.rid: r for r in done}
    assert set(by_rid) == {"many-0", "many-1", "many-2"}
    assert by_rid["many-1"].finish_reason == "abort"
    assert by_rid["many-0"].output_ids == ref[0]
    assert by_rid["many-2"].output_ids == ref[2]
    assert eng.pools_full()
