"""The role seam (docs/architecture.md: Roles): a role gets narrow collaborators, never the
engine, and touches no private name of another object."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from engine_helpers import get_llm

from pdserve.engine.role import RequestKV, RequestOutput, RequestQueue, Role

ROOT = Path(__file__).resolve().parents[2]
ROLE_FILES = ["pdserve/engine/role.py", "pdserve/pd/transfer_role.py", "prefill_node/role.py",
              "decode_node/role.py"]


def _protocol_methods(proto: type) -> list[str]:
    return [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]


def test_engine_collaborators_satisfy_the_role_protocols():
    engine = get_llm().engine
    ctx = engine.role.ctx
    pairs = [(RequestQueue, ctx.queue, engine.sched), (RequestOutput, ctx.output, engine.out),
             (RequestKV, ctx.kv, engine.kv)]
    for proto, given, concrete in pairs:
        assert given is concrete
        assert isinstance(given, proto), proto.__name__
        for name in _protocol_methods(proto):  # same parameter names as the Protocol says
            want = list(inspect.signature(getattr(proto, name)).parameters)[1:]
            have = list(inspect.signature(getattr(concrete, name)).parameters)
            assert have == want, f"{type(concrete).__name__}.{name}{have} != {proto.__name__}"
    assert not hasattr(engine.role, "engine")
    assert isinstance(engine.role, Role)


def test_roles_touch_no_private_name_of_another_object():
    """`x._name` only with x == self: roles use their context's public API."""
    bad = []
    for rel in ROLE_FILES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                bad.append(f"{rel}:{node.lineno}: .{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "engine":
                bad.append(f"{rel}:{node.lineno}: reaches for the engine")
    assert not bad, bad
