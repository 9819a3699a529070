"""The rendered chart, read back as YAML: replicas, registry wiring, store, RDMA, probes,
PDBs, metrics (issue 9, "Must show")."""

from __future__ import annotations

import base64
import subprocess

import helm_tool
import pytest
from manifests import (
    FULLNAME,
    TIERS,
    env_entry,
    find,
    flag,
    get,
    main_container,
    pdserve_argv,
    pod_spec,
    tier,
    workloads,
)

VALUE_SETS = sorted(helm_tool.value_sets())
REGISTRY_URL = f"http://{FULLNAME}-registry:8998"


def values_of(name: str) -> dict:
    return helm_tool.chart_values(helm_tool.value_sets()[name])


def test_ci_value_sets_are_the_four_of_the_issue():
    assert set(VALUE_SETS) == {"default", "external-redis", "rdma", "scale-4p8d"}
    v = values_of("scale-4p8d")
    assert (v["prefill"]["replicas"], v["decode"]["replicas"]) == (4, 8)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_each_tier_replicas_follow_values(render, values):
    docs, v = render(values), values_of(values)
    for name in TIERS:
        if v.get("autoscaling", {}).get(name, {}).get("enabled"):
            assert "replicas" not in tier(docs, name)["spec"], name  # the autoscaler's
            continue
        assert tier(docs, name)["spec"]["replicas"] == v[name]["replicas"], name
    assert (find(docs, "StatefulSet", f"{FULLNAME}-redis") is not None) == v["redis"]["enabled"]


def test_replica_overrides_reach_each_tier_independently(render):
    docs = render(None, {"prefill.replicas": "3", "decode.replicas": "5",
                         "router.replicas": "2", "registry.replicas": "2"})
    got = {n: tier(docs, n)["spec"]["replicas"] for n in TIERS}
    assert got == {"prefill": 3, "decode": 5, "router": 2, "registry": 2}


def test_scale_set_renders_four_prefill_eight_decode(render):
    docs = render("scale-4p8d")
    assert tier(docs, "prefill")["spec"]["replicas"] == 4
    assert tier(docs, "decode")["spec"]["replicas"] == 8
    assert get(docs, "PodDisruptionBudget", f"{FULLNAME}-decode")["spec"]["maxUnavailable"] == 2


@pytest.mark.parametrize("values", VALUE_SETS)
def test_registry_url_and_token_reach_every_node_and_the_router(render, values):
    docs, v = render(values), values_of(values)
    svc = get(docs, "Service", f"{FULLNAME}-registry")
    assert svc["spec"]["ports"][0]["port"] == v["registry"]["port"]
    registry = tier(docs, "registry")
    assert svc["spec"]["selector"].items() <= registry["spec"]["template"]["metadata"][
        "labels"].items()

    # The registry reads its token from a Secret mounted as a file.
    reg_argv = pdserve_argv(main_container(registry))
    token_file = flag(reg_argv, "--token-file")
    assert token_file is not None
    mount = next(m for m in main_container(registry)["volumeMounts"]
                 if token_file.startswith(m["mountPath"] + "/"))
    volume = next(vol for vol in pod_spec(registry)["volumes"] if vol["name"] == mount["name"])
    secret_name = volume["secret"]["secretName"]
    key = token_file.rsplit("/", 1)[1]
    if v["registry"]["auth"]["existingSecret"]:
        assert secret_name == v["registry"]["auth"]["existingSecret"]
    else:
        assert key in get(docs, "Secret", secret_name)["data"]
    assert ("--token-reads" in reg_argv) == v["registry"]["auth"]["tokenReads"]

    # Every node and the router get the registry Service URL and the same Secret's token,
    # as a mounted file (never argv or env).
    for name in ("prefill", "decode", "router"):
        workload = tier(docs, name)
        container = main_container(workload)
        argv = pdserve_argv(container)
        assert argv[0] == name
        assert flag(argv, "--registry") == REGISTRY_URL, name
        assert "--registry-token" not in argv, name
        path = flag(argv, "--registry-token-file")
        mount = next(m for m in container["volumeMounts"]
                     if path.startswith(m["mountPath"] + "/"))
        vol = next(x for x in pod_spec(workload)["volumes"] if x["name"] == mount["name"])
        assert (vol["secret"]["secretName"], path.rsplit("/", 1)[1]) == (secret_name, key)
        assert "PDSERVE_REGISTRY_TOKEN" not in {e["name"] for e in container["env"]}, name


def test_fixed_token_lands_in_the_secret(render):
    docs = render("scale-4p8d")
    secret = get(docs, "Secret", f"{FULLNAME}-registry-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "a-fixed-token-for-ci"


def test_auth_off_drops_token_everywhere(render):
    docs = render(None, {"registry.auth.enabled": "false"})
    assert find(docs, "Secret", f"{FULLNAME}-registry-token") is None
    for name in TIERS:
        container = main_container(tier(docs, name))
        argv = pdserve_argv(container)
        assert "--registry-token" not in argv and "--token-file" not in argv
        assert "PDSERVE_REGISTRY_TOKEN" not in {e["name"] for e in container.get("env", [])}


def _store_url(docs) -> str:
    """The registry's --store-file, followed to the Secret mounted there."""
    registry = tier(docs, "registry")
    container = main_container(registry)
    path = flag(pdserve_argv(container), "--store-file")
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    vol = next(x for x in pod_spec(registry)["volumes"] if x["name"] == mount["name"])
    secret = get(docs, "Secret", vol["secret"]["secretName"])
    return base64.b64decode(secret["data"][path.rsplit("/", 1)[1]]).decode()


def test_registry_store_is_the_bundled_redis_by_default(render):
    docs = render("default")
    argv = pdserve_argv(main_container(tier(docs, "registry")))
    assert "--store" not in argv  # the URL holds the Redis password: a file, not argv
    password = base64.b64decode(get(docs, "Secret", f"{FULLNAME}-redis")["data"][
        "password"]).decode()
    assert _store_url(docs) == f"redis://:{password}@{FULLNAME}-redis:6379/0"
    get(docs, "StatefulSet", f"{FULLNAME}-redis")
    assert get(docs, "Service", f"{FULLNAME}-redis")["spec"]["ports"][0]["port"] == 6379


def test_registry_store_external_redis_comes_from_a_secret(render):
    docs = render("external-redis")
    assert find(docs, "StatefulSet", f"{FULLNAME}-redis") is None
    assert "--store" not in pdserve_argv(main_container(tier(docs, "registry")))
    assert _store_url(docs) == values_of("external-redis")["externalRedis"]["url"]


def test_registry_without_redis_keeps_memory_and_one_replica(render, helm):
    docs = render(None, {"redis.enabled": "false"})
    assert flag(pdserve_argv(main_container(tier(docs, "registry"))), "--store") == "memory"
    with pytest.raises(subprocess.CalledProcessError) as err:
        helm_tool.render(helm, None, {"redis.enabled": "false", "registry.replicas": "2"})
    assert "needs a shared store" in err.value.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_rdma_values_give_host_network_ipc_lock_device_and_mooncake_rdma(render, role):
    docs, v = render("rdma"), values_of("rdma")["rdma"]
    workload = tier(docs, role)
    spec, container = pod_spec(workload), main_container(workload)
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"  # registry Service still resolves
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    for part in ("requests", "limits"):
        assert str(container["resources"][part][v["resourceName"]]) == str(v["resourceCount"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1  # tier resources kept
    argv = pdserve_argv(container)
    assert flag(argv, "--transfer-backend") == "mooncake"
    assert flag(argv, "--mooncake-protocol") == "rdma"
    assert flag(argv, "--mooncake-device") == v["device"]
    assert spec["nodeSelector"] and spec["tolerations"]


@pytest.mark.parametrize("values", ["default", "external-redis", "scale-4p8d"])
def test_no_rdma_settings_without_rdma(render, values):
    docs = render(values)
    for role in ("prefill", "decode"):
        workload = tier(docs, role)
        container = main_container(workload)
        assert not pod_spec(workload).get("hostNetwork")
        caps = container.get("securityContext", {}).get("capabilities", {}).get("add", [])
        assert "IPC_LOCK" not in caps
        assert not any(k.startswith("rdma/") for k in container["resources"].get("limits", {}))
        argv = pdserve_argv(container)
        assert flag(argv, "--mooncake-protocol") in (None, "tcp")
        assert "--mooncake-device" not in argv


@pytest.mark.parametrize("values", VALUE_SETS)
def test_nodes_bind_and_advertise_the_pod_ip(render, values):
    """http_url and the KV endpoint are built from --host/--kv-host: they must be reachable."""
    docs = render(values)
    for role in ("prefill", "decode"):
        container = main_container(tier(docs, role))
        argv = pdserve_argv(container)
        assert flag(argv, "--host") == "$(POD_IP)"
        assert flag(argv, "--kv-host") == "$(POD_IP)"
        assert env_entry(container, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP")
        assert flag(argv, "--port") == str(container["ports"][0]["containerPort"])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_probes_split_liveness_and_readiness(render, values):
    """Liveness asks /livez (restart only a broken process), readiness /readyz."""
    docs = render(values)
    for name in TIERS:
        container = main_container(tier(docs, name))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
            get_ = container[probe]["httpGet"]
            assert get_["path"] == path, (name, probe)
            assert get_["port"] in ports, (name, probe)
        if "startupProbe" in container:
            assert container["startupProbe"]["httpGet"]["path"] == "/livez"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_one_pdb_per_tier_selecting_its_pods(render, values):
    docs = render(values)
    for name in TIERS:
        pdb = get(docs, "PodDisruptionBudget", f"{FULLNAME}-{name}")
        labels = tier(docs, name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("values", VALUE_SETS)
def test_selectors_match_pod_labels(render, values):
    docs = render(values)
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items()
                   <= w["spec"]["template"]["metadata"]["labels"].items()
                   for w in workloads(docs)), svc["metadata"]["name"]


def test_prometheus_annotations_by_default(render):
    docs = render("default")
    for name in ("prefill", "decode", "router"):
        workload = tier(docs, name)
        ann = workload["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/path"] == "/metrics"
        assert ann["prometheus.io/port"] == str(main_container(workload)["ports"][0][
            "containerPort"])
    assert not any(d["kind"] == "ServiceMonitor" for d in docs)


def test_service_monitor_when_enabled(render):
    docs = render("external-redis")
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    for name in ("prefill", "decode", "router"):
        svc = get(docs, "Service", f"{FULLNAME}-{name}")
        assert "http" in {p["name"] for p in svc["spec"]["ports"]}
        assert "annotations" not in tier(docs, name)["spec"]["template"]["metadata"]


def test_router_service_and_ingress(render):
    docs = render("rdma")
    ing = get(docs, "Ingress", f"{FULLNAME}-router")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == f"{FULLNAME}-router"
    assert ing["spec"]["tls"][0]["secretName"] == "llm-example-tls"
    assert find(render("default"), "Ingress", f"{FULLNAME}-router") is None
    assert get(render("external-redis"), "Service", f"{FULLNAME}-router")["spec"][
        "type"] == "LoadBalancer"


def test_model_volume_and_init_step(render):
    rdma = render("rdma")
    for name in ("prefill", "decode", "router"):
        spec = pod_spec(tier(rdma, name))
        assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == "llm-models"
        mount = main_container(tier(rdma, name))["volumeMounts"][0]
        assert (mount["mountPath"], mount["readOnly"]) == ("/models", True)
        assert flag(pdserve_argv(main_container(tier(rdma, name))), "--model") == (
            "/models/Qwen2.5-7B-Instruct")
    scale = render("scale-4p8d")
    for name in ("prefill", "decode", "router"):
        spec = pod_spec(tier(scale, name))
        init = spec["initContainers"][0]
        cache = values_of("scale-4p8d")["model"]["cacheDir"]
        assert flag(pdserve_argv(init), "--model-cache-dir") == cache
        assert init["volumeMounts"][0]["mountPath"] == cache
        assert main_container(tier(scale, name))["volumeMounts"][0]["mountPath"] == cache
