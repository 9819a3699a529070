"""Helpers to look into rendered manifests (lists of parsed YAML documents)."""

from __future__ import annotations

import re

import helm_tool

FULLNAME = f"{helm_tool.RELEASE}-pdserve"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
TIERS = ("registry", "prefill", "decode", "router")
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def find(docs: list[dict], kind: str, name: str) -> dict | None:
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    return None


def get(docs: list[dict], kind: str, name: str) -> dict:
    doc = find(docs, kind, name)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert doc is not None, f"no {kind} {name} in {names}"
    return doc


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d.get("kind") in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict, init: bool = True) -> list[dict]:
    spec = pod_spec(workload)
    return (spec.get("initContainers", []) if init else []) + spec["containers"]


def tier(docs: list[dict], name: str) -> dict:
    """The workload of a tier (registry, prefill, decode, router, redis)."""
    for kind in ("Deployment", "StatefulSet"):
        if (doc := find(docs, kind, f"{FULLNAME}-{name}")) is not None:
            return doc
    raise AssertionError(f"no workload for tier {name}")


def main_container(workload: dict) -> dict:
    return pod_spec(workload)["containers"][0]


def pdserve_argv(container: dict) -> list[str] | None:
    """The argv after the program name when the container runs `pdserve`, else None."""
    cmd = list(container.get("command", [])) + list(container.get("args", []))
    if not cmd or cmd[0] != "pdserve":
        return None
    return [str(a) for a in cmd[1:]]


def flag(argv: list[str], name: str) -> str | None:
    """Value of `--name V` (last one wins, as argparse), None when absent."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def env_names(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


def env_entry(container: dict, name: str) -> dict:
    for e in container.get("env", []):
        if e["name"] == name:
            return e
    raise AssertionError(f"container {container['name']} has no env var {name}")
