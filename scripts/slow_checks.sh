#!/usr/bin/env bash
# Slow checks (not part of CI): the tests marked `slow` (pyproject.toml), e.g. the chaos
# soak's quick run (tests/soak). Run before resolving an issue that touches what they cover.
#
#   bash scripts/slow_checks.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -p no:randomly -m slow "$@"
