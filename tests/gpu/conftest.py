"""CUDA tests (docs/architecture.md: Overlap scheduling, KV transfer). They run where
`torch.cuda.is_available()`; elsewhere every test here is reported as skipped with the
reason: the only skip the suite allows. `scripts/gpu_check.sh` runs them on a GPU machine.

The engine and PD helper modules of tests/engine and tests/pd are imported from here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
for sub in ("engine", "kernels", "pd"):
    path = str(HERE.parent / sub)
    if path not in sys.path:
        sys.path.insert(0, path)

SKIP_REASON = "CUDA is not available here: tests/gpu run on a GPU machine (scripts/gpu_check.sh)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
