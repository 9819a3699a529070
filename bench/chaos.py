"""Chaos soak: a 2P2D stack (bench/chaos_cluster.py) under steady mixed load for a while
(bench/chaos_requests.py: the three HTTP APIs, streaming or not, greedy or sampled, with
or without logprobs), while a seeded schedule kills -9 and restarts prefill nodes, decode
nodes (one of them while it holds requests before their first token) and the registry,
pauses a node (SIGSTOP, then SIGCONT) and clients drop their connections mid-stream.
Bounded in time, loopback only, stops everything by itself.

At the end every request must have either completed right (greedy: exactly the offline
engine's output; logprobs: one per token; sampled: complete), or failed with a clear error
(an HTTP error status with a JSON message, or an in-band error event) within its deadline
after some output reached the client (a failure before any output is one the router
could have retried: none may remain); nothing may hang; and every live node must report
its KV pages, request slots, metadata rows, transfer rooms and quarantined pages back to
full/empty.

    python bench/chaos.py [--quick] [--minutes M] [--seed S] [--faults KIND,...] [--out PATH]

Exit status 0 only when that verdict holds (tests/soak runs `--quick`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402
from chaos_cluster import MODEL, Cluster, Member  # noqa: E402
from chaos_requests import Outcome, make_outcome, one_request, wrong  # noqa: E402

DEADLINE_S = 150.0  # per request: the router's --request-timeout-s (120) plus slack


async def send(router: str, o: Outcome, out: list[Outcome]) -> None:
    out.append(o)
    async with httpx.AsyncClient(timeout=None) as client:
        await one_request(client, router, MODEL, o, T0, DEADLINE_S)


async def load(router: str, workers: int, stop: asyncio.Event, rng: random.Random,
               out: list[Outcome]) -> None:
    async def worker() -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            while not stop.is_set():
                o = make_outcome(rng)
                out.append(o)
                await one_request(client, router, MODEL, o, T0, DEADLINE_S)

    await asyncio.gather(*(worker() for _ in range(workers)))


def pick_victim(cluster: Cluster, role: str, rng: random.Random) -> Member | None:
    """A ready member of `role`, only while another of that role is ready too (the
    stack must stay able to serve)."""
    ready = [m for m in cluster.nodes() if m.name.startswith(role) and m.alive
             and not m.paused and m.ready()]
    return rng.choice(ready) if len(ready) >= 2 else None


FAULTS = ["kill_decode_early", "kill_decode", "kill_prefill", "kill_registry", "pause_node"]
BURST = 8  # kill_decode_early: long prompts sent at once, so some wait for their first token


def waiting_for_first_token(m: Member) -> int:
    """Requests a decode node holds that have no first token yet (pages allocated, KV on
    its way): its pre-allocation and transfer queues."""
    try:
        role = (httpx.get(f"{m.url}/server_info", timeout=2).json().get("stats") or {}
                ).get("role") or {}
    except (httpx.HTTPError, ValueError):
        return 0
    return int(role.get("prealloc_queue", 0)) + int(role.get("transfer_queue", 0))


async def early_victim(cluster: Cluster, rng: random.Random,
                       outcomes: list[Outcome]) -> tuple[Member | None, list]:
    """Send a burst of long greedy prompts, then find a decode node holding some of them
    before their first token (while another decode is ready). The burst's requests are
    judged like every other: a retry on the other pair must serve them."""
    burst = []
    for _ in range(BURST):
        o = Outcome([rng.randrange(10, 40000) for _ in range(rng.randrange(600, 900))],
                    rng.randrange(4, 48), logprobs=rng.random() < 0.5)
        burst.append(asyncio.create_task(send(cluster.router, o, outcomes)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ready = [m for m in cluster.nodes() if m.name.startswith("decode") and m.alive
                 and not m.paused]
        if len(ready) >= 2:
            held = await asyncio.gather(*(asyncio.to_thread(waiting_for_first_token, m)
                                          for m in ready))
            busy = [m for m, n in zip(ready, held, strict=True) if n]
            if busy:
                return rng.choice(busy), burst
        await asyncio.sleep(0.02)
    return None, burst


async def ready_victim(cluster: Cluster, role: str, rng: random.Random, stop: asyncio.Event,
                       wait_s: float) -> Member | None:
    """pick_victim, waiting up to `wait_s` (or until `stop`) for a restarted node to be
    ready again: on a slow machine a restart takes longer than the fault interval."""
    deadline = time.monotonic() + wait_s
    while (victim := await asyncio.to_thread(pick_victim, cluster, role, rng)) is None:
        if stop.is_set() or time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.5)
    return victim


async def faults(cluster: Cluster, rng: random.Random, interval_s: float, stop: asyncio.Event,
                 log: Counter, kinds: list[str], outcomes: list[Outcome],
                 played: asyncio.Event) -> None:
    """Inject faults until `stop`: `kinds` in order first, then at random; `played` is set
    once each of the first pass was injected or skipped for good."""
    i, pending = 0, []
    retry: list[str] = []  # a kind skipped once (no victim yet): tried again next time
    while not stop.is_set():
        if i >= len(kinds) and not retry:
            played.set()
        await asyncio.sleep(interval_s * rng.uniform(0.6, 1.4))
        if stop.is_set():
            break
        if retry:
            kind = retry.pop()
        else:
            kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
            i += 1
        if kind == "kill_registry":
            victim: Member | None = cluster.members["registry"]
        elif kind == "kill_decode_early":
            victim, burst = await early_victim(cluster, rng, outcomes)
            pending += burst
        else:
            role = {"kill_prefill": "prefill", "kill_decode": "decode"}.get(kind) \
                or rng.choice(["prefill", "decode"])  # pause_node: either role
            victim = await ready_victim(cluster, role, rng, stop, interval_s)
        if victim is None:
            # On a loaded machine a restarted node may not be back yet, or a burst already
            # served: once more at the next fault, so a short run still injects each kind.
            if not log[f"{kind}_skipped"]:
                retry.append(kind)
            log[f"{kind}_skipped"] += 1
            continue
        log[kind] += 1
        print(f"  t+{time.monotonic() - T0:5.0f}s  {kind}: {victim.name}", flush=True)
        if kind == "pause_node":
            victim.paused = True
            victim.signal_group(19)  # SIGSTOP
            await asyncio.sleep(2.0)
            victim.signal_group(18)  # SIGCONT
            victim.paused = False
        else:
            await asyncio.to_thread(victim.kill9)
            await asyncio.sleep(0.5)
            victim.spawn()  # comes back as a new instance on the same port
    await asyncio.gather(*pending)


def leaks(cluster: Cluster, timeout_s: float = 90) -> dict[str, str]:
    """Live nodes that do not report everything back to full/empty within the time."""
    deadline, bad = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        bad = {m.name: why for m in cluster.nodes() if (why := _not_full(m.url))}
        if not bad:
            return {}
        time.sleep(0.5)
    return bad


def _not_full(url: str) -> str:
    try:
        info = httpx.get(f"{url}/server_info", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        return f"unreadable: {exc!r}"
    s = info.get("stats") or {}
    role = s.get("role") or {}
    checks = {
        "kv pages": s.get("pools_full"), "running": s.get("running") == 0,
        "waiting": s.get("waiting") == 0, "slots": s.get("free_slots") == s.get("total_slots"),
        "open http": info.get("open_requests") == 0,
        "queues": not any(v for k, v in role.items() if k.endswith("_queue")),
        "metadata rows": role.get("free_metadata_slots", 0) == role.get("total_metadata_slots",
                                                                         0),
        "rooms": not (role.get("transfer") or {}).get("live_rooms"),
        "quarantined pages": not (role.get("transfer") or {}).get("quarantined_pages")}
    return ", ".join(k for k, ok in checks.items() if not ok)


def reference(outcomes: list[Outcome]) -> list[tuple[list[int], str]]:
    """The offline engine's greedy (ids, text) for each of `outcomes` (chat prompts through
    the model's chat template, as the router renders them)."""
    from pdserve import LLM, SamplingParams
    from pdserve.http.protocol import chat_prompt_ids

    llm = LLM(MODEL)
    try:
        params = [SamplingParams(max_new_tokens=o.max_new, temperature=0, ignore_eos=True)
                  for o in outcomes]
        prompts = [chat_prompt_ids(llm.tokenizer, o.messages) if o.api == "chat" else o.prompt
                   for o in outcomes]
        return [(r.output_ids, r.text) for r in llm.generate(prompts, params)]
    finally:
        llm.close()


def router_counters(router: str) -> dict[str, float]:
    """The router's retry and migration counters (pdserve_router_*_total)."""
    out: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"{router}/metrics", timeout=5).text.splitlines():
            for name in ("retries", "migrations"):
                if line.startswith(f"pdserve_router_{name}_total"):
                    out[name] = out.get(name, 0) + float(line.rsplit(" ", 1)[1])
    return out


async def soak(cluster: Cluster, args) -> tuple[list[Outcome], Counter]:
    rng, fault_log, outcomes = random.Random(args.seed), Counter(), []
    stop_load, stop_faults = asyncio.Event(), asyncio.Event()
    loader = asyncio.create_task(load(cluster.router, args.workers, stop_load,
                                      random.Random(args.seed + 1), outcomes))
    played = asyncio.Event()
    chaos = asyncio.create_task(faults(cluster, rng, args.fault_interval_s, stop_faults,
                                       fault_log, args.faults, outcomes, played))
    await asyncio.sleep(args.minutes * 60)
    # A short run on a slow machine (restarts of tens of seconds) goes on until the first
    # pass of the schedule was played, within a bound.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(played.wait(),
                               timeout=2 * args.fault_interval_s * len(args.faults))
    stop_faults.set()
    await chaos
    for m in cluster.members.values():  # every member back before the load ends
        if not m.alive or not m.ready():
            await asyncio.to_thread(m.wait_ready)
    await asyncio.sleep(3)
    stop_load.set()
    await loader
    return outcomes, fault_log


def main() -> int:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0,
                   help="length of the load; the run goes on until each fault kind in "
                        "--faults was played once (at most two fault intervals per kind more)")
    p.add_argument("--fault-interval-s", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="tcp", choices=["tcp", "mooncake"])
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="comma-separated kinds, played in this order first, then at random")
    args = p.parse_args()
    args.faults = args.faults.split(",")
    if bad := set(args.faults) - set(FAULTS):
        p.error(f"unknown fault kind(s) {sorted(bad)}; choose from {FAULTS}")
    if args.quick:  # every fault kind once, on average, within the run
        args.minutes, args.fault_interval_s, args.workers = 0.9, 9.0, 4
    global T0
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    cluster = Cluster(log_dir, 2, 2, args.backend)
    try:
        cluster.start()
        T0 = time.monotonic()
        outcomes, fault_log = asyncio.run(soak(cluster, args))
        leaked = leaks(cluster)
        router = router_counters(cluster.router)
        for name in leaked:  # what the node held, for whoever reads the failure
            m = cluster.members[name]
            with contextlib.suppress(httpx.HTTPError):
                (log_dir / f"{name}.server_info.json").write_text(
                    httpx.get(f"{m.url}/server_info", timeout=5).text)
    finally:
        cluster.stop()
    return verdict(outcomes, fault_log, leaked, router, args, log_dir)


def verdict(outcomes: list[Outcome], fault_log: Counter, leaked: dict, router: dict, args,
            log_dir) -> int:
    ok = [o for o in outcomes if o.result == "ok"]
    greedy = [o for o in ok if o.greedy]
    refs = dict(zip(map(id, greedy), reference(greedy), strict=True)) if greedy else {}
    wrongs = [(o, why) for o in ok
              if (why := wrong(o, *refs.get(id(o), (None, None))))]
    by = Counter(o.result for o in outcomes)
    failed = [o for o in outcomes if o.result in ("error", "unclear", "hung")]
    # Nothing had reached the client: the router could have served these on another pair.
    retryable = [o for o in failed if not o.output_seen]
    causes = Counter(o.error.split(":")[0] + ": " + o.error.split(":", 1)[-1][:60]
                     for o in failed)
    rows = [{"what": k, "count": v} for k, v in sorted({**by, **fault_log}.items())]
    rows += [{"what": f"router {k}", "count": v} for k, v in sorted(router.items())]
    rows += [{"what": f"ok {k}", "count": v}
             for k, v in sorted(Counter(o.label() for o in ok).items())]
    rows += [{"what": f"failed: {k}", "count": v} for k, v in causes.most_common(8)]
    rows += [{"what": f"wrong {o.label()}: {why}", "count": 1} for o, why in wrongs[:8]]
    print_table(rows, ["what", "count"])
    summary = {"requests": len(outcomes), "ok": by["ok"], "exact": len(ok) - len(wrongs),
               "wrong_output": len(wrongs), "failed_clear": by["error"],
               "retryable_failures": len(retryable), "unclear": by["unclear"],
               "hung": by["hung"], "dropped_by_client": by["dropped"],
               "ok_by_kind": dict(Counter(o.label() for o in ok)),
               "faults": dict(fault_log), "router": router, "leaks": leaked,
               "log_dir": str(log_dir),
               # when each failure started and how long it took, to match with the logs
               "failures": [{"started_s": round(o.started, 1), "seconds": round(o.seconds, 1),
                             "kind": o.label(), "result": o.result, "error": o.error[:300]}
                            for o in failed]}
    summary["passed"] = bool(outcomes and ok and not wrongs and not retryable
                             and not by["unclear"] and not by["hung"] and not leaked)
    print(json.dumps({k: v for k, v in summary.items()
                      if k not in ("faults", "failures", "ok_by_kind")}))
    write_json(args.out, summary, rows, args)
    return 0 if summary["passed"] else 1


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
