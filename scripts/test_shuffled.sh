#!/usr/bin/env bash
# Slow check (not part of CI): the whole test suite RUNS times in shuffled order
# (pytest-randomly: modules, classes and tests reordered, a new seed each run) beside a
# busy-loop CPU hog, to catch tests that depend on file order or on an idle machine.
#
#   bash scripts/test_shuffled.sh [RUNS] [--no-hog] [-- extra pytest args]
#
# Each run prints its seed (rerun one order with `-p randomly -p "randomly" --randomly-seed=S`)
# and the pytest summary line; the exit status is non-zero when any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
hog=1
extra=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --no-hog) hog=0 ;;
        --) shift; extra=("$@"); break ;;
        [0-9]*) runs="$1" ;;
        *) echo "usage: bash scripts/test_shuffled.sh [RUNS] [--no-hog] [-- pytest args]" >&2; exit 2 ;;
    esac
    shift
done
bash scripts/setup.sh
. .venv/bin/activate
python -c "import pytest_randomly" 2>/dev/null || pip install -q "pytest-randomly==5.1.0"
if python -c "import redis; redis.Redis(host='127.0.0.1', port=6379, socket_timeout=1).ping()" 2>/dev/null; then
    export PDSERVE_TEST_REDIS_URL="redis://127.0.0.1:6379/15"
fi

hog_pid=""
cleanup() { if [ -n "$hog_pid" ]; then kill "$hog_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT
if [ "$hog" = 1 ]; then
    python3 -c "while True: pass" &
    hog_pid=$!
fi

failed=0
for i in $(seq "$runs"); do
    seed=$(python -c "import random; print(random.randrange(1, 2**31))")
    log="$(mktemp -t pdserve-shuffled-XXXXXX.log)"
    start=$(date +%s)
    echo "run $i/$runs: seed $seed, log $log"
    set +e
    python -m pytest -q -p no:cacheprovider -p randomly --randomly-seed="$seed" "${extra[@]}" >"$log" 2>&1
    rc=$?
    set -e
    echo "run $i/$runs: exit $rc in $(( $(date +%s) - start ))s: $(tail -n 1 "$log")"
    if [ "$rc" != 0 ]; then
        failed=1
        grep -E "^(FAILED|ERROR) " "$log" || true
    fi
done
exit "$failed"
