#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what scripts/gpu_check.sh needs on the lent GPU machine,
# which reaches no package registry (docs/gpu.md). That machine has Python 3.12 with
# torch 2.11 + CUDA 13, transformers, msgpack, httpx, prometheus-client; it lacks pdserve's
# server packages, the CUDA 13 Mooncake wheel and its system libraries, and the tokenizer
# files the tiny and synthetic models copy (they come from the SmolLM2 GGUF here).
#
#   scripts/gpu_wheels.sh [--no-mooncake]     # then: ls -la .whl; du -sh .whl
#
# Everything is downloaded with --no-deps for cp312 / manylinux x86-64, one version of
# each (two would stop the install). The whole working tree travels in at most 64 MiB;
# the Mooncake wheel alone is ~50 MB, so this script fails if .whl/ exceeds 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MOONCAKE=1
[ "${1:-}" = "--no-mooncake" ] && MOONCAKE=0
MOONCAKE_WHEEL="mooncake-transfer-engine-cuda13==0.3.14"

# Same versions as this machine's environment where installed (pyproject pins what matters).
PKGS=(fastapi starlette uvicorn pyzmq redis gguf pydantic pydantic-core annotated-types
      typing-inspection typing-extensions opentelemetry-api)
version_of() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }

rm -rf .whl
mkdir -p .whl/debs .whl/tokenizer
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -q)
for p in "${PKGS[@]}"; do
    v=$(version_of "$p")
    "$PY" -m pip download "${args[@]}" "$p${v:+==$v}"
done
if [ "$MOONCAKE" = 1 ]; then
    "$PY" -m pip download "${args[@]}" "$MOONCAKE_WHEEL"
    # Mooncake's engine.so links libibverbs, libmlx5 and libnuma, absent from that image.
    # Debian bookworm builds (older glibc than the GPU image's) are unpacked there into a
    # private folder on LD_LIBRARY_PATH, never into /.
    (cd .whl/debs && apt-get download libibverbs1 ibverbs-providers libnuma1 libnl-3-200 \
        libnl-route-3-200 >/dev/null 2>&1) ||
        { apt-get update >/dev/null 2>&1 && (cd .whl/debs && apt-get download libibverbs1 \
            ibverbs-providers libnuma1 libnl-3-200 libnl-route-3-200 >/dev/null); }
fi

# Tokenizer files of SmolLM2 (the tiny and synthetic models reuse them).
tok=$("$PY" -c 'from pdserve.models.builtin import resolve_model; print(resolve_model("smollm2-135m"))')
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
    [ -f "$tok/$f" ] && cp "$tok/$f" .whl/tokenizer/
done

size=$(du -sm .whl | cut -f1)
ls -la .whl
echo "gpu_wheels: .whl/ holds ${size} MiB"
if [ "$size" -gt 60 ]; then
    echo "gpu_wheels: over 60 MiB: the working tree would not travel (try --no-mooncake)" >&2
    exit 1
fi
