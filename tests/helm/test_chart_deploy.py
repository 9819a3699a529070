"""Rendered chart, issue 14: drain timing, secrets as files with checksums, Redis auth and
PDB, NetworkPolicies, RDMA memlock/GID/strategy, name lengths, SSE ingress, topology spread,
autoscaling (the metric names are checked against live nodes in test_chart_metrics.py)."""

from __future__ import annotations

import base64
import hashlib

import pytest
from manifests import FULLNAME, find, flag, get, main_container, pdserve_argv, pod_spec, tier

PD = ("prefill", "decode")


def _secret(docs, name: str, key: str) -> str:
    return base64.b64decode(get(docs, "Secret", name)["data"][key]).decode()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_drain_flags_prestop_and_grace_period_follow_values(render):
    docs = render(None, {"pd.drainTimeoutS": "90", "pd.drainGraceS": "4",
                         "pd.preStopSleepS": "6", "router.preStopSleepS": "7",
                         "router.drainTimeoutS": "45"})
    for role in PD:
        w = tier(docs, role)
        c, argv = main_container(w), pdserve_argv(main_container(w))
        assert (flag(argv, "--drain-timeout-s"), flag(argv, "--drain-grace-s")) == ("90", "4")
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "6"]
        # Kubernetes kills at the grace period: it must cover preStop + the whole drain.
        assert pod_spec(w)["terminationGracePeriodSeconds"] >= 6 + 90 + 4
    router = tier(docs, "router")
    assert main_container(router)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    assert flag(pdserve_argv(main_container(router)), "--drain-timeout-s") == "45"
    assert pod_spec(router)["terminationGracePeriodSeconds"] > 7 + 45  # + open streams' drain
    no_sleep = render(None, {"pd.preStopSleepS": "0"})
    assert "lifecycle" not in main_container(tier(no_sleep, "decode"))


def test_checksums_of_secrets_restart_pods_when_they_change(render):
    a = render(None, {"registry.auth.token": '"one"', "redis.auth.password": '"p1"'})
    b = render(None, {"registry.auth.token": '"two"', "redis.auth.password": '"p1"'})
    for name in ("registry", *PD, "router"):
        ann = tier(a, name)["spec"]["template"]["metadata"]["annotations"]
        assert ann["checksum/registry-token"] == _sha("one"), name
        assert ann != tier(b, name)["spec"]["template"]["metadata"]["annotations"], name
    store = _secret(a, f"{FULLNAME}-registry-store", "url")
    reg_ann = tier(a, "registry")["spec"]["template"]["metadata"]["annotations"]
    assert reg_ann["checksum/registry-store"] == _sha(store)
    redis_ann = tier(a, "redis")["spec"]["template"]["metadata"]["annotations"]
    assert redis_ann["checksum/redis-password"] == _sha("p1")


def test_one_random_token_per_render_is_the_one_checksummed(render):
    docs = render("default")  # no token given: random, but the same value everywhere
    token = _secret(docs, f"{FULLNAME}-registry-token", "token")
    assert len(token) == 40
    for name in ("registry", *PD, "router"):
        ann = tier(docs, name)["spec"]["template"]["metadata"]["annotations"]
        assert ann["checksum/registry-token"] == _sha(token), name


def test_redis_requires_a_password_kept_out_of_argv(render):
    docs = render(None, {"redis.auth.password": '"pw-123"'})
    redis = main_container(tier(docs, "redis"))
    assert "pw-123" not in " ".join(redis.get("command", []) + redis.get("args", []))
    assert "requirepass" in redis["args"][0] and "redis-server -" in redis["args"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]}
    assert set(refs) == {"REDIS_PASSWORD", "REDISCLI_AUTH"}
    assert all(r == {"name": f"{FULLNAME}-redis", "key": "password"} for r in refs.values())
    assert _secret(docs, f"{FULLNAME}-redis", "password") == "pw-123"
    assert "pw-123" in _secret(docs, f"{FULLNAME}-registry-store", "url")
    off = render(None, {"redis.auth.enabled": "false"})
    assert find(off, "Secret", f"{FULLNAME}-redis") is None
    assert _secret(off, f"{FULLNAME}-registry-store", "url") == (
        f"redis://{FULLNAME}-redis:6379/0")


def test_redis_persistence_and_pdb(render):
    docs = render("scale-4p8d")
    sts = tier(docs, "redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"][
        "storage"] == "2Gi"
    pdb = get(docs, "PodDisruptionBudget", f"{FULLNAME}-redis")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"][
        "metadata"]["labels"].items()
    assert find(render("default"), "PodDisruptionBudget", f"{FULLNAME}-redis") is None
    assert "volumeClaimTemplates" not in tier(render("default"), "redis")["spec"]


def _peers(policy: dict) -> list[tuple[set, set]]:
    """Per ingress rule: the components it admits (None: anyone) and its ports."""
    out = []
    for rule in policy["spec"]["ingress"]:
        comps = set()
        for peer in rule.get("from", [None]):
            labels = (peer or {}).get("podSelector", {}).get("matchLabels", {})
            comps.add(labels.get("app.kubernetes.io/component", "*release*" if labels
                                 else "*other*" if peer else "*anyone*"))
        out.append((comps, {p["port"] for p in rule.get("ports", [])}))
    return out


def test_network_policies_allow_only_the_documented_paths(render):
    docs = render("default")
    pol = {n: get(docs, "NetworkPolicy", f"{FULLNAME}-{n}")
           for n in ("router", *PD, "registry", "redis")}
    for name, p in pol.items():
        assert p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == name
        assert p["spec"]["policyTypes"] == ["Ingress"]
    assert _peers(pol["router"]) == [({"*anyone*"}, {"http"})]
    for role in PD:  # router -> HTTP; the other PD nodes -> any port (KV); scrapers -> HTTP
        assert _peers(pol[role]) == [({"router"}, {"http"}), ({"prefill", "decode"}, set()),
                                     ({"*other*"}, {"http"})]
    assert _peers(pol["registry"]) == [({"*release*"}, {"http"})]
    assert _peers(pol["redis"]) == [({"registry"}, {"redis"})]
    restricted = render("external-redis")  # routerFrom set; no bundled Redis
    assert find(restricted, "NetworkPolicy", f"{FULLNAME}-redis") is None
    rules = get(restricted, "NetworkPolicy", f"{FULLNAME}-router")["spec"]["ingress"]
    assert rules[0]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ingress-nginx"}
    assert not any(d["kind"] == "NetworkPolicy"
                   for d in render(None, {"networkPolicy.enabled": "false"}))


def test_rdma_profile_can_lock_memory_and_sets_gid_and_strategy(render):
    docs = render("rdma", {"rdma.gidIndex": "3"})
    for role in PD:
        w = tier(docs, role)
        sc = main_container(w)["securityContext"]
        assert "IPC_LOCK" in sc["capabilities"]["add"]
        assert (sc["runAsUser"], sc["runAsNonRoot"]) == (0, False)  # IPC_LOCK works as root
        env = {e["name"]: e.get("value") for e in main_container(w)["env"]}
        assert env["MC_GID_INDEX"] == "3"
        assert w["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    nonroot = render("rdma", {"rdma.runAsRoot": "false"})
    sc = main_container(tier(nonroot, "decode"))["securityContext"]
    assert "runAsUser" not in sc and "IPC_LOCK" in sc["capabilities"]["add"]
    default = render("default")
    for role in PD:
        assert "strategy" not in tier(default, role)["spec"]
        assert "MC_GID_INDEX" not in {e["name"] for e in main_container(tier(default, role))[
            "env"]}


def test_long_release_names_leave_room_for_suffixes(helm):
    import helm_tool
    import yaml

    long = "a-very-long-release-name-for-a-production-cluster-xyz"  # 52 characters
    out = helm_tool.subprocess.run(
        [str(helm), "template", long, str(helm_tool.CHART), "-n", "pd"],
        capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    for d in docs:
        name = d["metadata"]["name"]
        assert len(name) <= 63 and not name.endswith("-"), name
        if d["kind"] == "StatefulSet":
            assert len(name) <= 52, name  # its pods' controller-revision-hash label


def test_ingress_is_sse_safe(render):
    ing = get(render("rdma"), "Ingress", f"{FULLNAME}-router")
    ann = ing["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert ann["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "3600"
    assert ann["nginx.ingress.kubernetes.io/proxy-send-timeout"] == "3600"
    mine = render("rdma", {"router.ingress.annotations": '{"a/b": "c"}',
                           "router.ingress.sse.enabled": "false"})
    assert get(mine, "Ingress", f"{FULLNAME}-router")["metadata"]["annotations"] == {"a/b": "c"}


def test_topology_spread_per_tier(render):
    docs = render("default")
    for name in ("registry", *PD, "router"):
        w = tier(docs, name)
        (c,) = pod_spec(w)["topologySpreadConstraints"]
        assert c["topologyKey"] == "kubernetes.io/hostname"
        assert c["whenUnsatisfiable"] == "ScheduleAnyway"
        assert c["labelSelector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"][
            "labels"].items()
    off = render(None, {"topologySpread.enabled": "false"})
    assert "topologySpreadConstraints" not in pod_spec(tier(off, "decode"))


def test_autoscaling_off_by_default_hpa_and_keda_when_on(render):
    default = render("default")
    assert not any(d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject") for d in default)
    docs = render("external-redis")  # prefill: hpa, decode: keda
    hpa = get(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-prefill")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-prefill"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    metric = hpa["spec"]["metrics"][0]["pods"]
    assert metric["metric"]["name"] == "pdserve_num_requests_waiting"
    assert metric["target"] == {"type": "AverageValue", "averageValue": "4"}
    so = get(docs, "ScaledObject", f"{FULLNAME}-decode")
    assert so["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-decode"
    trig = so["spec"]["triggers"][0]
    assert trig["type"] == "prometheus" and trig["metadata"]["threshold"] == "0.7"
    assert trig["metadata"]["query"].startswith("sum(pdserve_kv_cache_usage_ratio{")
    assert f'pod=~"{FULLNAME}-decode-.*"' in trig["metadata"]["query"]
    for role in PD:  # the autoscaler owns the replica count
        assert "replicas" not in tier(docs, role)["spec"]


def test_unknown_autoscaler_kind_is_refused(helm):
    import subprocess

    import helm_tool

    with pytest.raises(subprocess.CalledProcessError) as err:
        helm_tool.render(helm, None, {"autoscaling.decode.enabled": "true",
                                      "autoscaling.decode.kind": '"vpa"'})
    assert "must be hpa or keda" in err.value.stderr


def test_prepare_onto_a_volume_converts_where_the_tiers_read(render):
    docs = render(None, {"model.prepare": "true", "model.readOnly": "false",
                         "model.volume": '{"persistentVolumeClaim": {"claimName": "m"}}'})
    for name in (*PD, "router"):
        w = tier(docs, name)
        init = pod_spec(w)["initContainers"][0]
        cache = flag(pdserve_argv(init), "--model-cache-dir")
        assert cache.startswith("/models/"), cache  # on the volume, not the image
        assert flag(pdserve_argv(main_container(w)), "--model-cache-dir") == cache
        assert any(cache.startswith(m["mountPath"] + "/") for m in init["volumeMounts"])
