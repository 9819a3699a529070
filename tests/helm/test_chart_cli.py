"""Every container of the chart runs a real `pdserve` subcommand whose flags the project's own
argument parser accepts, and every `$(VAR)` in its args is an env var the container defines.
The `pdserve bench` command NOTES.txt prints parses too."""

from __future__ import annotations

import argparse
import re
import subprocess

import helm_tool
import pytest
from manifests import (
    ENV_REF,
    FULLNAME,
    containers,
    env_names,
    flag,
    main_container,
    pdserve_argv,
    tier,
    workloads,
)

from pdserve.cli import build_parser

VALUE_SETS = sorted(helm_tool.value_sets())
DUMMY = {"POD_IP": "10.1.2.3", "POD_NAME": "pod-0", "PDSERVE_REGISTRY_TOKEN": "dummy-token",
         "PDSERVE_REGISTRY_STORE": "redis://redis.example:6379/0"}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("pdserve's parser has no subcommands")


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse with pdserve's parser; argparse's SystemExit on a bad flag becomes a failure."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"pdserve's parser rejects {argv}: exit {exc.code}")


def substitute(argv: list[str], defined: set[str]) -> list[str]:
    out = []
    for arg in argv:
        for name in ENV_REF.findall(arg):
            # Kubernetes leaves an undefined $(VAR) as is: that would be a silent bug.
            assert name in defined, f"{arg!r} refers to an env var the container lacks"
        out.append(ENV_REF.sub(lambda m: DUMMY.get(m.group(1), f"dummy-{m.group(1)}"), arg))
    return out


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_container_command_parses_with_the_pdserve_cli(render, values):
    docs = render(values)
    known = subcommands(build_parser())
    seen = set()
    for workload in workloads(docs):
        for container in containers(workload):
            argv = pdserve_argv(container)
            if argv is None:  # Redis, and the kv-store's mooncake_master (image's wheel)
                assert container["name"] in ("redis", "kv-store"), \
                    f"{container['name']} does not run pdserve"
                continue
            assert argv, f"{container['name']}: `pdserve` without a subcommand"
            if argv[0] == "router" and "router" not in known:
                continue  # the router's CLI is not in this tree yet; checked once it is
            assert argv[0] in known, f"{argv[0]!r} is not a pdserve subcommand"
            ns = parse(substitute(argv, env_names(container)))
            seen.add(argv[0])
            if argv[0] in ("prefill", "decode", "router"):
                url = getattr(ns, "registry_url", None) or getattr(ns, "registry", None)
                assert url == f"http://{FULLNAME}-registry:8998"
    expected = {"registry", "prefill", "decode"} | ({"router"} & set(known))
    assert expected <= seen


@pytest.mark.parametrize("values", ["default", "rdma"])
def test_parsed_node_config_carries_chart_values(render, values):
    docs = render(values)
    v = helm_tool.chart_values(helm_tool.value_sets()[values])
    for workload in workloads(docs):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        argv = pdserve_argv(container)
        if not argv or argv[0] not in ("prefill", "decode"):
            continue
        ns = parse(substitute(argv, env_names(container)))
        assert ns.host == DUMMY["POD_IP"] and ns.kv_host == DUMMY["POD_IP"]
        assert ns.node_id == DUMMY["POD_NAME"]
        assert ns.registry_token == "" and ns.registry_token_file is not None
        assert ns.page_size == v["engine"]["pageSize"]
        assert ns.tp_size == v["engine"].get("tpSize", 1)
        assert ns.transfer_backend == v["transfer"]["backend"]
        assert ns.max_running_requests == v[argv[0]]["maxRunningRequests"]
        assert ns.threads == v[argv[0]].get("threads", 0)  # pods sharing a host split it
        if v["rdma"]["enabled"]:
            assert (ns.mooncake_protocol, ns.mooncake_device) == ("rdma", v["rdma"]["device"])


def test_notes_tell_how_to_reach_the_router_and_bench_it(helm):
    out = subprocess.run([str(helm), "install", helm_tool.RELEASE, str(helm_tool.CHART),
                          "--dry-run=client", "--namespace", helm_tool.NAMESPACE],
                         capture_output=True, text=True, check=True).stdout
    notes = out.split("NOTES:", 1)[1]
    assert f"svc/{FULLNAME}-router" in notes
    joined = re.sub(r"\\\n\s*", "", notes)
    bench = [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("pdserve bench")]
    assert bench, notes
    for line in bench:
        argv = line.split()[1:]
        argv = [a.replace("$PDSERVE_URL", "http://127.0.0.1:8000") for a in argv]
        ns = parse(argv)
        assert ns.base_url.startswith("http://")


def test_hicache_values_reach_their_tier_and_parse(render):
    """`prefill.hicache.enabled` turns HiCache on for the prefill tier only, with the tier's
    ratio, size and write policy, as flags pdserve's parser accepts."""
    docs = render(None, {"prefill.hicache.enabled": "true", "prefill.hicache.ratio": "3.5",
                         "prefill.hicache.writePolicy": '"write_back"'})
    pre = pdserve_argv(main_container(tier(docs, "prefill")))
    dec = pdserve_argv(main_container(tier(docs, "decode")))
    assert "--enable-hierarchical-cache" in pre and "--enable-hierarchical-cache" not in dec
    assert (flag(pre, "--hicache-ratio"), flag(pre, "--hicache-size"),
            flag(pre, "--hicache-write-policy")) == ("3.5", "0", "write_back")
    ns = parse(substitute(pre, {"POD_IP", "POD_NAME", "PDSERVE_REGISTRY_TOKEN",
                                "PDSERVE_REGISTRY_STORE"}))
    assert ns.enable_hierarchical_cache and ns.hicache_ratio == 3.5
    off = pdserve_argv(main_container(tier(render(), "prefill")))
    assert "--enable-hierarchical-cache" not in off


def test_kv_store_gives_prefill_pods_a_mooncake_tier(render):
    """kvStore.enabled: a mooncake_master Deployment and Service, every prefill pod pointed
    at it (flags pdserve's parser accepts), decode pods untouched, off by default."""
    docs = render("scale-4p8d")
    store = tier(docs, "kv-store")
    c = main_container(store)
    assert c["command"] == ["mooncake_master"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"rpc": 50051, "metadata": 8080}
    pre = pdserve_argv(main_container(tier(docs, "prefill")))
    dec = pdserve_argv(main_container(tier(docs, "decode")))
    assert flag(pre, "--hicache-storage-backend") == "mooncake"
    assert flag(pre, "--hicache-mooncake-master") == f"{FULLNAME}-kv-store:50051"
    assert flag(pre, "--hicache-mooncake-metadata-url") == \
        f"http://{FULLNAME}-kv-store:8080/metadata"
    assert flag(pre, "--hicache-mooncake-segment-mb") == "2048"
    assert "--hicache-storage-backend" not in dec
    ns = parse(substitute(pre, {"POD_IP", "POD_NAME", "PDSERVE_REGISTRY_TOKEN",
                                "PDSERVE_REGISTRY_STORE"}))
    assert ns.hicache_storage_backend == "mooncake" and ns.enable_hierarchical_cache
    assert not any(d.get("metadata", {}).get("name") == f"{FULLNAME}-kv-store"
                   for d in render())


def test_a_hub_model_gets_its_revision_load_format_and_token_file(render):
    docs = render(None, {"model.name": '"acme/big-model"', "model.revision": '"v1.2"',
                         "model.loadFormat": '"dummy"', "model.hfTokenSecret": '"hf-token"',
                         "model.prepare": "true"})
    for name in ("prefill", "decode", "router"):
        w = tier(docs, name)
        spec = w["spec"]["template"]["spec"]
        secret = [v for v in spec["volumes"] if v["name"] == "hf-token"]
        assert secret == [{"name": "hf-token", "secret": {"secretName": "hf-token"}}]
        for c in (main_container(w), *spec.get("initContainers", [])):
            argv = pdserve_argv(c)
            ns = parse(substitute(argv, env_names(c)))
            assert (ns.model, ns.revision) == ("acme/big-model", "v1.2"), c["name"]
            if argv[0] != "router":
                assert ns.load_format == "dummy", c["name"]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            path = env["HF_TOKEN_PATH"]  # a file: the token is in no env value, no argument
            mounts = [m for m in c["volumeMounts"] if m["name"] == "hf-token"]
            assert mounts and path.startswith(mounts[0]["mountPath"] + "/"), c["name"]
            assert all(e["name"] != "HF_TOKEN" for e in c.get("env", []))
    plain = render(None)
    for w in workloads(plain):
        for c in containers(w):
            assert "--revision" not in (pdserve_argv(c) or [])
            assert all(e["name"] != "HF_TOKEN_PATH" for e in c.get("env", []))
