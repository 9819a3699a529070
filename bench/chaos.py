"""Chaos soak: a 2P2D stack (bench/chaos_cluster.py) under steady greedy load for a while,
while a seeded schedule kills -9 and restarts prefill nodes, decode nodes and the
registry, pauses a node (SIGSTOP, then SIGCONT) and clients drop their connections
mid-stream. Bounded in time, loopback only, stops everything by itself.

At the end every request must have either completed with exactly the offline greedy
output, or failed with a clear error (an HTTP error status with a JSON message, or an
in-band error event) within its deadline; nothing may hang; and every live node must
report its KV pages, request slots, metadata rows and transfer rooms back to full/empty.

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
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402
from chaos_cluster import MODEL, Cluster, Member  # noqa: E402

DEADLINE_S = 150.0  # per request: the router's --request-timeout-s (120) plus slack


@dataclass
class Outcome:
    prompt: list[int]
    max_new: int
    kind: str = "normal"  # normal | drop (the client leaves after two events)
    result: str = "hung"  # ok | error | dropped | unclear | hung
    ids: list[int] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    started: float = 0.0  # seconds after the soak began


async def one_request(client: httpx.AsyncClient, router: str, o: Outcome) -> None:
    body = {"input_ids": o.prompt, "stream": True, "sampling_params": {
        "max_new_tokens": o.max_new, "temperature": 0, "ignore_eos": True}}
    t0 = time.monotonic()
    o.started = t0 - T0
    try:
        await asyncio.wait_for(_stream(client, router, body, o), DEADLINE_S)
    except TimeoutError:
        o.result, o.error = "hung", f"no end within {DEADLINE_S:.0f}s"
    except httpx.HTTPError as exc:
        o.result, o.error = "unclear", f"transport: {exc!r}"
    o.seconds = time.monotonic() - t0


async def _stream(client: httpx.AsyncClient, router: str, body: dict, o: Outcome) -> None:
    async with client.stream("POST", f"{router}/generate", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            try:
                msg = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = ""
            o.result = "error" if msg else "unclear"
            o.error = f"{resp.status_code}: {msg or resp.text[:100]}"
            return
        events = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                o.result = "ok"
                return
            event = json.loads(line[6:])
            if "error" in event:
                o.result, o.error = "error", f"in-band: {event['error'].get('message')}"
                return
            o.ids = event["output_ids"]
            events += 1
            if o.kind == "drop" and events >= 2:
                o.result = "dropped"
                return
        o.result, o.error = "unclear", "stream ended without [DONE] or an error"


async def load(router: str, workers: int, stop: asyncio.Event, rng: random.Random,
               out: list[Outcome]) -> None:
    async def worker() -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            while not stop.is_set():
                o = Outcome([rng.randrange(10, 40000) for _ in range(rng.randrange(8, 160))],
                            rng.randrange(4, 48), "drop" if rng.random() < 0.1 else "normal")
                out.append(o)
                await one_request(client, router, o)

    await asyncio.gather(*(worker() for _ in range(workers)))


def pick_victim(cluster: Cluster, role: str, rng: random.Random) -> Member | None:
    """A ready member of `role`, only while another of that role is ready too (the
    stack must stay able to serve)."""
    ready = [m for m in cluster.nodes() if m.name.startswith(role) and m.alive
             and not m.paused and m.ready()]
    return rng.choice(ready) if len(ready) >= 2 else None


FAULTS = ["kill_decode", "kill_prefill", "kill_registry", "pause_node"]


async def faults(cluster: Cluster, rng: random.Random, interval_s: float, stop: asyncio.Event,
                 log: Counter, kinds: list[str]) -> None:
    i = 0
    while not stop.is_set():
        await asyncio.sleep(interval_s * rng.uniform(0.6, 1.4))
        if stop.is_set():
            return
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        i += 1
        if kind == "kill_registry":
            victim: Member | None = cluster.members["registry"]
        else:
            role = {"kill_prefill": "prefill", "kill_decode": "decode"}.get(kind) \
                or rng.choice(["prefill", "decode"])  # pause_node: either role
            victim = await asyncio.to_thread(pick_victim, cluster, role, rng)
        if victim is None:
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
        "rooms": not (role.get("transfer") or {}).get("live_rooms")}
    return ", ".join(k for k, ok in checks.items() if not ok)


def reference(outcomes: list[Outcome]) -> list[list[int]]:
    from pdserve import LLM, SamplingParams

    llm = LLM(MODEL)
    try:
        params = [SamplingParams(max_new_tokens=o.max_new, temperature=0, ignore_eos=True)
                  for o in outcomes]
        return [r.output_ids for r in llm.generate([o.prompt for o in outcomes], params)]
    finally:
        llm.close()


async def soak(cluster: Cluster, args) -> tuple[list[Outcome], Counter]:
    rng, fault_log, outcomes = random.Random(args.seed), Counter(), []
    stop_load, stop_faults = asyncio.Event(), asyncio.Event()
    loader = asyncio.create_task(load(cluster.router, args.workers, stop_load,
                                      random.Random(args.seed + 1), outcomes))
    chaos = asyncio.create_task(faults(cluster, rng, args.fault_interval_s, stop_faults,
                                       fault_log, args.faults))
    await asyncio.sleep(args.minutes * 60)
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
    p.add_argument("--minutes", type=float, default=10.0)
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
    if args.quick:
        args.minutes, args.fault_interval_s, args.workers = 0.75, 10.0, 4
    global T0
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    cluster = Cluster(log_dir, 2, 2, args.backend)
    try:
        cluster.start()
        T0 = time.monotonic()
        outcomes, fault_log = asyncio.run(soak(cluster, args))
        leaked = leaks(cluster)
        for name in leaked:  # what the node held, for whoever reads the failure
            m = cluster.members[name]
            with contextlib.suppress(httpx.HTTPError):
                (log_dir / f"{name}.server_info.json").write_text(
                    httpx.get(f"{m.url}/server_info", timeout=5).text)
    finally:
        cluster.stop()
    return verdict(outcomes, fault_log, leaked, args, log_dir)


def verdict(outcomes: list[Outcome], fault_log: Counter, leaked: dict, args, log_dir) -> int:
    ok = [o for o in outcomes if o.result == "ok"]
    refs = reference(ok) if ok else []
    wrong = sum(o.ids != r for o, r in zip(ok, refs, strict=True))
    by = Counter(o.result for o in outcomes)
    causes = Counter(o.error.split(":")[0] + ": " + o.error.split(":", 1)[-1][:60]
                     for o in outcomes if o.result in ("error", "unclear", "hung"))
    rows = [{"what": k, "count": v} for k, v in sorted({**by, **fault_log}.items())]
    rows += [{"what": f"failed: {k}", "count": v} for k, v in causes.most_common(8)]
    print_table(rows, ["what", "count"])
    summary = {"requests": len(outcomes), "ok": by["ok"], "exact": len(ok) - wrong,
               "wrong_output": wrong, "failed_clear": by["error"], "unclear": by["unclear"],
               "hung": by["hung"], "dropped_by_client": by["dropped"],
               "faults": dict(fault_log), "leaks": leaked, "log_dir": str(log_dir),
               # when each failure started and how long it took, to match with the logs
               "failures": [{"started_s": round(o.started, 1), "seconds": round(o.seconds, 1),
                             "result": o.result, "error": o.error[:300]}
                            for o in outcomes if o.result in ("error", "unclear", "hung")]}
    summary["passed"] = bool(outcomes and ok and not wrong and not by["unclear"]
                             and not by["hung"] and not leaked)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("faults", "failures")}))
    write_json(args.out, summary, rows, args)
    return 0 if summary["passed"] else 1


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
