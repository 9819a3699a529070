"""The import direction docs/architecture.md states (Module map: Import direction), checked
on the source: every import of every module counts, lazy ones inside functions included;
only those under `if TYPE_CHECKING:` (annotations, never run) do not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pdserve", "bootstrap", "kv_transfer", "prefill_node", "decode_node")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _modules() -> dict[str, set[str]]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = _imports(f)
    return mods


MODULES = _modules()


def _in(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _offenders(importer: tuple[str, ...], banned: tuple[str, ...],
               allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{m} imports {i}" for m, imps in MODULES.items()
                  if _in(m, *importer) and not _in(m, *allowed)
                  for i in imps if _in(i, *banned))


# (who, must not import, except these modules of `who`): each row is one sentence of
# docs/architecture.md: Import direction.
RULES = {
    "kv_transfer is standalone: no torch, nothing of pdserve": (
        ("kv_transfer",), ("torch", "pdserve", "bootstrap", "prefill_node", "decode_node"), ()),
    "the registry loads no model, engine, node or router": (
        ("bootstrap",), ("torch", "pdserve.engine", "pdserve.models", "pdserve.node",
                         "pdserve.router", "pdserve.pd", "kv_transfer"), ()),
    "pdserve.http is shared by node and router and imports neither": (
        ("pdserve.http",), ("torch", "pdserve.node", "pdserve.router", "pdserve.engine",
                            "pdserve.pd", "prefill_node", "decode_node"), ()),
    "the router never touches a node's engine or PD roles": (
        ("pdserve.router",), ("torch", "pdserve.node", "pdserve.engine", "pdserve.pd",
                              "prefill_node", "decode_node", "kv_transfer"), ()),
    "the engine knows no node, router, HTTP or role; only a TP worker rank runs its "
    "share of PD transfers": (
        ("pdserve.engine",), ("pdserve.node", "pdserve.router", "pdserve.http",
                              "prefill_node", "decode_node", "pdserve.pd"),
        ("pdserve.engine.tp_worker",)),
    "the shared PD layer serves the roles and the node, and imports neither": (
        ("pdserve.pd",), ("pdserve.node", "pdserve.router", "pdserve.http", "prefill_node",
                          "decode_node"), ()),
    "a role knows no HTTP, router or other role; only its CLI entry reaches the node": (
        ("prefill_node", "decode_node"), ("pdserve.router", "pdserve.http"), ()),
    "the prefill role does not import the decode role": (
        ("prefill_node",), ("decode_node",), ()),
    "the decode role does not import the prefill role": (
        ("decode_node",), ("prefill_node",), ()),
}
# Besides the node itself, only these command-line entries import it.
NODE_IMPORTERS = ("pdserve.cli", "prefill_node.cli", "decode_node.cli")


@pytest.mark.parametrize("rule", list(RULES))
def test_import_direction(rule: str):
    assert not _offenders(*RULES[rule]), rule


def test_only_command_line_entries_import_the_node():
    offenders = sorted(f"{m} imports {i}" for m, imps in MODULES.items()
                       if not _in(m, "pdserve.node") and m not in NODE_IMPORTERS
                       for i in imps if _in(i, "pdserve.node"))
    assert not offenders


def test_the_check_sees_imports():
    # The scan itself: it finds a lazy import inside a function, skips TYPE_CHECKING ones.
    assert "pdserve.pd.bounce" in MODULES["pdserve.pd.transfer_setup"]
    assert "pdserve.pd.leg" not in MODULES["pdserve.engine.engine"]
    assert _offenders(("prefill_node.role",), ("pdserve.engine",))  # a real edge is found
