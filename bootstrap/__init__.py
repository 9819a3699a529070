"""Bootstrap registry: where prefill/decode nodes register and the router finds them.

- `bootstrap.app` / `bootstrap.cli`: the HTTP service (`pdserve registry`).
- `bootstrap.client.RegistryClient`: what nodes and the router use.
- `bootstrap.record`: the node record (docs/architecture.md: Registry).

Names below are imported lazily: a node importing the client must not pay for FastAPI.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "KVLayoutRecord",
    "NodeLoad",
    "NodeRecord",
    "RegisteredNode",
    "RegistryClient",
    "RegistryConfig",
    "new_instance_id",
]

_HOMES = {
    "KVLayoutRecord": "bootstrap.record",
    "NodeLoad": "bootstrap.record",
    "NodeRecord": "bootstrap.record",
    "RegisteredNode": "bootstrap.record",
    "new_instance_id": "bootstrap.record",
    "RegistryClient": "bootstrap.client",
    "RegistryConfig": "bootstrap.config",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(name)
