#!/usr/bin/env bash
# One prepared check of pdserve on a single-GPU machine (docs/gpu.md), within 8 minutes:
#   1. install the wheels carried in .whl/ (scripts/gpu_wheels.sh fills it; that machine
#      reaches no registry) into a private folder, unpack Mooncake's system libraries
#   2. build the tiny and synthetic models from the carried tokenizer files
#   3. pytest tests/gpu                                  -> OUT/gpu_tests.log, .xml
#   4. bench/gpu_model.py, synthetic-8b (Llama-3-8B shape): decode at bs 1/8/32/128 x
#      context 1k/4k, 4k prefill, the mixed-batch memory probe, memory used, each beside
#      the HBM limit                                      -> OUT/gpu_model.json
#   5. bench/overlap.py, synthetic-1b on cuda, bs 1/8/32/128 -> OUT/overlap.json
#   6. bench/kv_device.py, GPU->GPU KV transfer GB/s     -> OUT/kv_device.json
#   7. 1P1D `pdserve up` + `pdserve bench` on one GPU    -> OUT/pd_bench.jsonl
# and OUT/summary.json (every step's exit code and seconds, the benchmarks' summaries).
# Tensor parallelism (--tp-size, docs/tensor-parallel.md) is NOT run here: the lent
# machine has one GPU and a TP2 node puts rank r on cuda:r (NCCL), so it needs two. TP is
# checked on CPU (gloo) by tests/engine/test_engine_tp.py; summary.json says "tp": not run.
# Each step has its own time limit, cut to what is left of the overall budget.
#
#   scripts/gpu_check.sh OUTDIR                # on the GPU machine, from the repo root
#   scripts/gpu_check.sh OUTDIR --cpu-dry-run  # the same steps at tiny size on CPU
# PYTHON names the interpreter (default python3, the one holding torch on that machine).
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
USAGE="usage: scripts/gpu_check.sh OUTDIR [--cpu-dry-run] [--budget-s SECONDS (default 470)] [--archive FILE.tgz]"
OUT=${1:?$USAGE}
shift
DRY=0
BUDGET_S=470   # 8 minutes less a margin for the summary
ARCHIVE=""     # also pack OUTDIR into this .tgz (a device run returns only a few files)
while [ $# -gt 0 ]; do
    case $1 in
        --cpu-dry-run) DRY=1 ;;
        --budget-s) BUDGET_S=${2:?$USAGE}; shift ;;
        --archive) ARCHIVE=${2:?$USAGE}; shift ;;
        *) echo "$USAGE" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
END=$((SECONDS + BUDGET_S))
: >"$OUT/steps.tsv"

# step NAME LIMIT_S CMD...: run with a time limit (cut to the budget left), log to OUT/NAME.log
step() {
    local name=$1 limit=$2 left=$((END - SECONDS)) rc t0=$SECONDS
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        echo "== $name: skipped, the time budget is spent"
        printf '%s\t%s\t%s\n' "$name" "budget" 0 >>"$OUT/steps.tsv"
        return 1
    fi
    echo "== $name (limit ${limit}s)"
    # Shell functions (exported below) run in a child bash so that timeout can stop them.
    timeout -k 10 "$limit" bash -c '"$@"' step "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT/steps.tsv"
    echo "   rc=$rc in $((SECONDS - t0))s; tail of $OUT/$name.log:"
    tail -n 6 "$OUT/$name.log" | sed 's/^/   | /'
    return "$rc"
}

install_wheels() {
    local site=/tmp/pdserve-site libs=/tmp/pdserve-libs
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl || return 1
    fi
    mkdir -p "$libs"
    for deb in .whl/debs/*.deb; do
        [ -f "$deb" ] && dpkg -x "$deb" "$libs"
    done
    # libcudart.so.13 of the CUDA runtime wheel torch brought along, for Mooncake's engine
    local cudart
    cudart=$("$PY" - <<'PYEOF'
import pathlib, site
for root in site.getsitepackages():
    for f in pathlib.Path(root, "nvidia").rglob("libcudart.so.1*"):
        print(f.parent); raise SystemExit
PYEOF
)
    echo "export PYTHONPATH=$REPO:$site"
    echo "export LD_LIBRARY_PATH=$libs/usr/lib/x86_64-linux-gnu:$libs/lib/x86_64-linux-gnu${cudart:+:$cudart}:${LD_LIBRARY_PATH:-}"
}

env_report() {
    date -u
    nvidia-smi || true
    "$PY" - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
from kv_transfer import mooncake_import_error
from kv_transfer.compat import installed_mooncake_builds
print("mooncake builds", installed_mooncake_builds(), "import:", mooncake_import_error() or "ok")
PYEOF
}

seed_models() {
    # tiny-* and synthetic-* copy SmolLM2's tokenizer files; on the GPU machine they come
    # from .whl/tokenizer (no GGUF there), here from the converted smollm2-135m.
    "$PY" - "$@" <<'PYEOF'
import sys
from pathlib import Path
from pdserve.models.builtin import resolve_model
tok = Path(".whl/tokenizer")
for name in sys.argv[1:]:
    print(name, resolve_model(name, tokenizer_dir=tok if (tok / "tokenizer.json").exists() else None))
PYEOF
}

# 1P1D stack + load test; the router URL is read from `pdserve up`'s output.
pd_bench() {
    local model=$1 node_args=$2 n=$3 isl=$4 osl=$5 conc=$6 url="" pid i
    "$PY" -m pdserve.cli up --model "$model" --transfer-backend tcp --port 0 \
        --registry-port 0 --node-args "$node_args" --log-dir "$OUT/stack" \
        --startup-timeout-s 150 >"$OUT/stack_up.log" 2>&1 &
    pid=$!
    for i in $(seq 600); do
        url=$(grep -oE 'router +http://[0-9.:]+' "$OUT/stack_up.log" | awk '{print $2}' | head -1)
        [ -n "$url" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    if [ -z "$url" ]; then
        echo "stack did not come up:"; cat "$OUT/stack_up.log"
        kill "$pid" 2>/dev/null; wait "$pid"; return 1
    fi
    echo "router at $url"
    "$PY" -m pdserve.cli bench --base-url "$url" --dataset-name random --num-prompts "$n" \
        --random-input-len "$isl" --random-output-len "$osl" \
        --max-concurrency "$conc" --warmup-requests 2 --tokenizer "$model" \
        --output-file "$OUT/pd_bench.jsonl" --label "1P1D-$model" --disable-tqdm
    local rc=$?
    # The nodes' /server_info (transfer counters: bytes, rooms, latency) for the summary.
    "$PY" - "$OUT/stack_up.log" "$OUT/nodes_info.json" <<'PYEOF' || true
import json, re, sys, time, httpx
urls = dict(re.findall(r"^  ((?:prefill|decode)-\d+) +(http://[0-9.:]+)", open(sys.argv[1]).read(), re.M))
def idle(info):  # the stats are periodic (0.25 s): wait until they show the bench done
    s = info.get("stats") or {}
    return s.get("pools_full") and not s.get("running") and not s.get("waiting")
deadline = time.monotonic() + 20
while True:
    info = {name: httpx.get(f"{url}/server_info", timeout=10).json() for name, url in urls.items()}
    if all(idle(i) for i in info.values()) or time.monotonic() > deadline:
        break
    time.sleep(0.25)
json.dump(info, open(sys.argv[2], "w"), indent=2)
PYEOF
    kill "$pid" 2>/dev/null   # SIGTERM: `pdserve up` stops every child
    wait "$pid"
    return $rc
}

export OUT PY REPO
export -f install_wheels env_report seed_models pd_bench

if [ "$DRY" = 1 ]; then
    DEV=cpu; DTYPE=float32; BIG=synthetic-tiny
    MODEL_ARGS=(--quick)
    OVERLAP_ARGS=(--models "$BIG" --batches 1,8 --out-len 8 --repeats 1)
    KV_ARGS=(--tokens 256 --rooms 2 --backends tcp)
    PD_ARGS=("$BIG" "--device cpu --max-total-tokens 4096" 4 64 8 2)
    MODELS=(tiny-llama tiny-qwen2 "$BIG")
else
    DEV=cuda; DTYPE=bfloat16; BIG=synthetic-1b
    MODEL_ARGS=(--model synthetic-8b)
    OVERLAP_ARGS=(--models "$BIG" --batches 1,8,32,128 --out-len 128 --repeats 3 --threads 0)
    KV_ARGS=(--tokens 4096 --rooms 8 --backends tcp,mooncake)
    PD_ARGS=("$BIG" "--device cuda --dtype bfloat16 --max-total-tokens 131072" 96 1024 128 32)
    MODELS=(tiny-llama tiny-qwen2 "$BIG" synthetic-8b)
    if step install 90 install_wheels; then
        eval "$(grep '^export ' "$OUT/install.log")"
    fi
fi
export PYTHONPATH=${PYTHONPATH:-$REPO}
case ":$PYTHONPATH:" in *":$REPO:"*) ;; *) export PYTHONPATH=$REPO:$PYTHONPATH ;; esac

step env 60 env_report
step models 90 seed_models "${MODELS[@]}"
step gpu_tests 200 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu \
    --junitxml="$OUT/gpu_tests.xml"
step gpu_model 150 "$PY" bench/gpu_model.py --device "$DEV" "${MODEL_ARGS[@]}" \
    --out "$OUT/gpu_model.json"
step overlap 120 "$PY" bench/overlap.py --device "$DEV" --dtype "$DTYPE" "${OVERLAP_ARGS[@]}" \
    --out "$OUT/overlap.json"
step kv_device 90 "$PY" bench/kv_device.py --device "$DEV" "${KV_ARGS[@]}" \
    --out "$OUT/kv_device.json"
step pd_bench 150 pd_bench "${PD_ARGS[@]}"

"$PY" - "$OUT" "$DRY" <<'PYEOF'
import json, sys
from pathlib import Path
out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    steps[name] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(secs)}
summary = {"cpu_dry_run": dry, "steps": steps}
for name in ("gpu_model", "overlap", "kv_device"):
    f = out / f"{name}.json"
    if f.exists():
        summary[name] = json.loads(f.read_text())["summary"]
f = out / "pd_bench.jsonl"
if f.exists() and f.read_text().strip():
    row = json.loads(f.read_text().strip().splitlines()[-1])
    summary["pd_bench"] = {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
f = out / "nodes_info.json"
if f.exists():
    nodes = json.loads(f.read_text())
    summary["pd_transfer"] = {name: ((n.get("stats") or {}).get("role") or {}).get("transfer")
                              for name, n in nodes.items()}
    summary["pd_engines"] = {name: n.get("engine") for name, n in nodes.items()}
summary["tp"] = "not run: one GPU here; --tp-size 2 needs two (rank r on cuda:r)"
summary["ok"] = all(s["rc"] == 0 for s in steps.values())
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2)[:6000])
sys.exit(0 if summary["ok"] else 1)
PYEOF
rc=$?
if [ -n "$ARCHIVE" ]; then
    tar czf "$ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "archive: $ARCHIVE"
fi
exit $rc
