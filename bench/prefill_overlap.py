"""Overlapped vs normal prefill node: a stream of prompts through a real prefill engine that
sends KV to a real decode receiver (a decode engine in a child process) over Mooncake.

All prompts arrive at once (random ids, prefix cache off), each asks for one token, so the
decode only receives. The loops run on the same prompts, alternated in one run, one prefill
engine each (same decode); also "overlap-sync", the overlap loop syncing before each
prefill batch (the prefill node before it overlapped consecutive prefills). Per loop
(median repeat; ratios are medians of per-repeat ratios of back-to-back passes):
- prompt tokens/s: prompt tokens / (last KV complete on the decode - arrival);
- arrival -> KV complete on the decode (mean, p50, p99; CLOCK_MONOTONIC of both processes);
- hidden share: the part of the prefill's result-processing wall time (first tokens, KV
  sends; waiting for the forward excluded) during which a forward was running.
A colocated section measures the `consecutive_prefill` policy: TTFT and prompt tokens/s.

On a CPU the gain is small by construction: a prefill node's result processing costs ~0.1
ms of CPU per batch against a forward of ~5 ms (tiny-llama, 128 tokens) or ~330 ms
(smollm2-135m), and the scheduler and forward threads share the GIL and the cores;
`ideal_ratio` is the bound if they never contended. Overlap pays where forwards are fast.

    python bench/prefill_overlap.py [--quick] [--out bench/out/prefill_overlap.json]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from _common import base_parser, print_table, write_json  # noqa: E402

from decode_node.role import DecodeRole  # noqa: E402
from kv_transfer import KVTransferConfig  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.pd.leg import PDLegFields  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from prefill_node.role import PrefillRole  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
LOOPS = ("overlap", "overlap-sync", "normal")


def engine_cfg(args, **kw) -> EngineConfig:
    return EngineConfig(model=args.model, page_size=16, chunked_prefill_size=args.chunk,
                        max_prefill_tokens=args.batch_tokens, disable_prefix_cache=True,
                        max_running_requests=args.num_prompts, max_total_tokens=args.pool,
                        **kw)


def median_row(rows: list[dict]) -> dict:
    """The repeat with the median prompt tokens/s (a shared machine makes single runs noisy)."""
    return sorted(rows, key=lambda r: r["prompt_tok_s"])[len(rows) // 2]


def alternate(names: list[str], rep: int) -> list[str]:
    """Run order of one repeat: reversed every other repeat, so no loop always goes first."""
    return names if rep % 2 == 0 else names[::-1]


def paired_ratio(a: dict, b: dict, key: str) -> float:
    """Median over repeats of a/b, each repeat's two passes measured back to back."""
    ra, rb = a[f"{key}_runs"], b[f"{key}_runs"]
    return round(statistics.median(x / y for x, y in zip(ra, rb, strict=True)), 3)


# -- the decode receiver (child process) -----------------------------------------------------
def decode_main(conn, args) -> None:
    torch.set_num_threads(1)
    eng = Engine(engine_cfg(args), DecodeRole(KVTransferConfig(backend=args.backend),
                                              args.model))
    conn.send("ready")
    while True:
        if eng.has_work():
            for req in eng.step():
                conn.send(("done", req.rid, time.monotonic(), req.error))
            if not eng.has_runnable() and not conn.poll(0):
                time.sleep(0.0005)  # only transfers pending: let the KV threads run
        elif not conn.poll(0.01):
            continue
        while conn.poll(0):
            msg = conn.recv()
            if msg is None:
                eng.close()
                return
            rid, ids, room, endpoint = msg
            eng.add_request(rid, ids, SamplingParams(**vars(ONE)),
                            PDLegFields(bootstrap_room=room, prefill_kv_endpoints=(endpoint,)))


# -- one pass of the stream through one prefill engine ---------------------------------------
class Timeline:
    """Wall intervals of forwards (forward thread) and of result processing after the
    result is ready (scheduler thread), recorded by wrapping the engine's own calls."""

    def __init__(self, eng: Engine) -> None:
        self.fwd: list[tuple[float, float]] = []
        self.proc: list[tuple[float, float]] = []
        self.proc_cpu = 0.0  # thread CPU time of result processing (GIL waits excluded)
        run, process = eng.executor.runner.run, eng.out.process

        def timed_run(batch):
            t0 = time.perf_counter()
            try:
                return run(batch)
            finally:
                self.fwd.append((t0, time.perf_counter()))

        def timed_process(batch, handle):
            handle.tokens()  # waiting for the forward is not result processing
            t0, c0 = time.perf_counter(), time.thread_time()
            process(batch, handle)
            self.proc.append((t0, time.perf_counter()))
            self.proc_cpu += time.thread_time() - c0

        eng.executor.runner.run, eng.out.process = timed_run, timed_process

    def reset(self) -> None:
        self.fwd.clear()
        self.proc.clear()
        self.proc_cpu = 0.0

    def hidden_share(self) -> float:
        total = sum(b - a for a, b in self.proc)
        hidden = sum(max(0.0, min(b, fb) - max(a, fa))
                     for a, b in self.proc for fa, fb in self.fwd if fa < b and fb > a)
        return hidden / total if total else 0.0


def stream_pass(eng: Engine, tl: Timeline, conn, prompts, tag: str) -> dict:
    tl.reset()
    room0 = time.monotonic_ns() << 8
    t0 = time.monotonic()
    for i, ids in enumerate(prompts):
        rid = f"{tag}-{i}"
        conn.send((rid, ids, room0 + i, eng.role.mgr.endpoint))
        eng.add_request(rid, ids, SamplingParams(**vars(ONE)),
                        PDLegFields(bootstrap_room=room0 + i))
    done: dict[str, float] = {}
    steps0, fwd0 = eng.loop.stats.steps, eng.executor.forward_cpu_s
    sched0 = eng.loop.stats.sched_cpu_s
    while len(done) < len(prompts) or eng.has_work():
        if eng.has_work():
            for req in eng.step():
                assert req.error is None, req.error
        else:
            time.sleep(0.0005)
        while conn.poll(0):
            _, rid, t, err = conn.recv()
            assert err is None, err
            done[rid] = t - t0
    eng.loop.drain()
    assert eng.pools_full()
    lat = sorted(done.values())
    tokens = sum(len(p) for p in prompts)
    nb = max(len(tl.fwd), 1)
    return {"prompt_tok_s": tokens / lat[-1], "kv_complete_mean_ms": 1000 * statistics.mean(lat),
            "kv_complete_p50_ms": 1000 * lat[len(lat) // 2],
            "kv_complete_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "hidden_share": tl.hidden_share(), "batches": len(tl.fwd),
            "steps": eng.loop.stats.steps - steps0,
            "proc_ms_per_batch": 1000 * sum(b - a for a, b in tl.proc) / nb,
            "proc_cpu_ms_per_batch": 1000 * tl.proc_cpu / nb,
            "fwd_cpu_ms_per_batch": 1000 * (eng.executor.forward_cpu_s - fwd0) / nb,
            "sched_cpu_ms_per_batch": 1000 * (eng.loop.stats.sched_cpu_s - sched0) / nb}


def run_pd(args, prompts, repeats: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=decode_main, args=(child_conn, args), daemon=True)
    child.start()
    engines = {}
    try:
        assert conn.recv() == "ready"
        tc = KVTransferConfig(backend=args.backend)
        for loop in LOOPS:
            eng = Engine(engine_cfg(args, disable_overlap=loop == "normal"),
                         PrefillRole(tc, args.model))
            # The prefill node as it was before it overlapped consecutive prefills: the
            # loop syncs before every batch (a measurement instrument, not a node option).
            eng.loop.sync_consecutive_prefill = loop == "overlap-sync"
            engines[loop] = (eng, Timeline(eng))
        for loop, (eng, tl) in engines.items():  # warm-up: first-call costs, peer connect
            stream_pass(eng, tl, conn, prompts[:4], f"warm-{loop}")
        runs: dict[str, list[dict]] = {loop: [] for loop in engines}
        for rep in range(repeats):  # alternated: drifting machine load hits every loop alike
            for loop in alternate(list(engines), rep):
                eng, tl = engines[loop]
                runs[loop].append(stream_pass(eng, tl, conn, prompts, f"{loop}-{rep}"))
        return [{"model": args.model, "node": "prefill", "loop": loop, **median_row(r),
                 "overlap_disabled": dict(engines[loop][0].loop.stats.overlap_disabled),
                 "prompt_tok_s_runs": [round(x["prompt_tok_s"]) for x in r],
                 "kv_complete_mean_ms_runs": [round(x["kv_complete_mean_ms"], 1) for x in r]}
                for loop, r in runs.items()]
    finally:
        conn.send(None)
        child.join(60)
        for eng, _ in engines.values():
            eng.close()


# -- colocated: the consecutive-prefill policy --------------------------------------------------
def colocated_pass(eng: Engine, prompts, out_len: int) -> dict:
    params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(f"colo-{time.monotonic_ns()}-{i}", ids, SamplingParams(**vars(params)))
            for i, ids in enumerate(prompts)]
    t0 = time.perf_counter()
    eng.run_until_idle()
    wall = time.perf_counter() - t0
    ttft = sorted(r.first_token_time - r.arrival for r in reqs)
    return {"ttft_mean_ms": 1000 * statistics.mean(ttft),
            "ttft_p50_ms": 1000 * ttft[len(ttft) // 2],
            "prompt_tok_s": sum(len(p) for p in prompts) / wall, "wall_s": wall}


def run_colocated(args, prompts, repeats: int) -> list[dict]:
    """Both policies alternated; the median repeat (by mean TTFT) of each is reported."""
    engines = {p: Engine(engine_cfg(args, consecutive_prefill=p)) for p in ("sync", "overlap")}
    runs: dict[str, list[dict]] = {p: [] for p in engines}
    try:
        for eng in engines.values():
            colocated_pass(eng, prompts[:4], 2)
        for rep in range(repeats):
            for policy in alternate(list(engines), rep):
                runs[policy].append(colocated_pass(engines[policy], prompts, args.out_len))
    finally:
        for eng in engines.values():
            eng.close()
    med = {p: sorted(r, key=lambda x: x["ttft_mean_ms"])[len(r) // 2] for p, r in runs.items()}
    return [{"model": args.model, "node": "colocated", "loop": f"overlap/{p}", **med[p]}
            for p in engines]


def summarize(model: str, pd: list[dict], colo: list[dict]) -> dict:
    tag = "tiny" if model == "tiny-llama" else model.split("-")[0]
    (o, y, n), (s, v) = pd, colo
    # If the scheduler thread never contended with the forward (GIL, cores), a batch would
    # cost max(scheduler, forward) instead of their sum.
    sc, fw = n["sched_cpu_ms_per_batch"], n["fwd_cpu_ms_per_batch"]
    out = {"prompt_tok_s_ratio": paired_ratio(o, n, "prompt_tok_s"),
           "prompt_tok_s_ratio_vs_sync": paired_ratio(o, y, "prompt_tok_s"),
           "kv_complete_ratio_normal_over_overlap": paired_ratio(n, o, "kv_complete_mean_ms"),
           "ideal_ratio": round((sc + fw) / max(sc, fw), 3),
           "colocated_ttft_sync_over_overlap": round(s["ttft_mean_ms"] / v["ttft_mean_ms"], 3),
           "colocated_tok_s_overlap_over_sync": round(v["prompt_tok_s"] / s["prompt_tok_s"], 3)}
    for name, r in (("overlap", o), ("overlap_sync", y), ("normal", n)):
        out[f"prompt_tok_s_{name}"] = round(r["prompt_tok_s"])
        out[f"kv_complete_mean_ms_{name}"] = round(r["kv_complete_mean_ms"], 1)
        out[f"hidden_share_{name}"] = round(r["hidden_share"], 3)
    return {f"{k}_{tag}": v for k, v in out.items()}


def print_rows(rows: list[dict]) -> None:
    print_table([r for r in rows if r["node"] == "prefill"],
                ["model", "loop", "prompt_tok_s", "kv_complete_mean_ms", "kv_complete_p50_ms",
                 "kv_complete_p99_ms", "hidden_share", "proc_ms_per_batch",
                 "proc_cpu_ms_per_batch", "sched_cpu_ms_per_batch", "fwd_cpu_ms_per_batch",
                 "batches"])
    print_table([r for r in rows if r["node"] == "colocated"],
                ["model", "loop", "ttft_mean_ms", "ttft_p50_ms", "prompt_tok_s", "wall_s"])


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="default: tiny-llama (--quick) or "
                        "tiny-llama,smollm2-135m")
    parser.add_argument("--backend", default="mooncake", choices=["mooncake", "tcp"])
    parser.add_argument("--chunk", type=int, default=128, help="chunked_prefill_size")
    parser.add_argument("--batch-tokens", type=int, default=128, help="max_prefill_tokens")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=0, help="default: 32 with "
                        "--quick, else 64")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=0, help="passes per loop "
                        "(default: 5 with --quick, else 3)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = args.models or ("tiny-llama" if args.quick else "tiny-llama,smollm2-135m")
    args.num_prompts = args.num_prompts or (32 if args.quick else 64)
    args.out_len = 8
    repeats = args.repeats or (5 if args.quick else 3)
    rows, summary = [], {}
    for model in models.split(","):
        args.model = model
        args.pool = min(args.num_prompts * args.prompt_len, 16384) + 2048
        prompts = [[100 + (i * 7919 + j * 104729) % 40000 for j in range(args.prompt_len)]
                   for i in range(args.num_prompts)]
        pd = run_pd(args, prompts, repeats)
        colo = run_colocated(args, prompts, repeats)
        rows += pd + colo
        summary.update(summarize(model, pd, colo))
        print_rows(pd + colo)  # each model as soon as it is done
        write_json(args.out, summary, rows, args)
    print("summary:", summary)


if __name__ == "__main__":
    main()
