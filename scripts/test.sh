#!/usr/bin/env bash
# Set up and run the whole test suite. Uses the Redis on 127.0.0.1:6379 when one answers,
# otherwise starts a private redis-server on a free loopback port and stops it afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate

started_redis=""
cleanup() { if [ -n "$started_redis" ]; then kill "$started_redis" 2>/dev/null || true; fi; }
trap cleanup EXIT
if python -c "import redis,sys; redis.Redis(host='127.0.0.1', port=6379, socket_timeout=1).ping()" 2>/dev/null; then
    export PDSERVE_TEST_REDIS_URL="redis://127.0.0.1:6379/15"
else
    if ! command -v redis-server >/dev/null 2>&1; then
        (apt-get install -y redis-server >/dev/null 2>&1 ||
         (apt-get update >/dev/null 2>&1 && apt-get install -y redis-server >/dev/null 2>&1)) || true
    fi
    port=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
    redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize no >/tmp/pdserve-test-redis.log 2>&1 &
    started_redis=$!
    for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
    export PDSERVE_TEST_REDIS_URL="redis://127.0.0.1:$port/15"
fi

ruff check .
# mypy's incremental cache in the user's cache folder, like pip's and the kernels' builds:
# a fresh clone then checks only what differs from the last check on this machine (~1 s
# instead of ~45). The cache is keyed by file contents, so sharing it is safe.
MYPY_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/mypy" mypy  # settings in pyproject.toml
# File order (reproducible); scripts/test_shuffled.sh runs the shuffled orders. `no:randomly`
# keeps it so where pytest-randomly is installed, and is a no-op where it is not.
# `-m "not slow"`: the long checks run in `bash scripts/slow_checks.sh` (README).
# Two pytest-xdist workers, whole files to each (`loadfile`: a module's fixtures, stacks and
# engines stay in one process, and its tests keep their file order); tests/README.md: Memory.
# `--no-loadscope-reorder`: files go out in collection order, which tests/conftest.py
# starts with the longest files (LONGEST_FIRST).
python -m pytest -q -p no:randomly -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder \
    --durations=25 "$@"
