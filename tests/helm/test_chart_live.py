"""What the chart renders, run for real on this machine:

- the bundled Redis's command (password on stdin) with the local redis-server: it refuses
  clients without the password, and the registry started with the rendered flags and the
  store URL from the rendered Secret (--store-file) uses it;
- every metric an autoscaler (HPA or KEDA) of a tier refers to is one that a live node of
  that tier exports at /metrics.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time

import httpx
import pytest
from live_procs import free_port, pdserve, running, serving_url
from manifests import FULLNAME, get, main_container, pdserve_argv, tier

PASSWORD = "pw-for-the-test"


def _secret(docs, name: str, key: str) -> str:
    return base64.b64decode(get(docs, "Secret", name)["data"][key]).decode()


def test_rendered_redis_requires_its_password_and_the_registry_uses_it(render, tmp_path):
    port = free_port()  # redis-server (not our server) reports no port it picked itself
    docs = render(None, {"redis.auth.password": f'"{PASSWORD}"', "redis.port": str(port),
                         "registry.auth.token": '"t"'})
    redis = main_container(tier(docs, "redis"))
    assert redis["command"] == ["sh", "-c"]
    env = {"REDIS_PASSWORD": _secret(docs, f"{FULLNAME}-redis", "password")}
    with running(["sh", "-c", *redis["args"]], tmp_path / "redis.log", env) as proc:
        cli = ["redis-cli", "-p", str(port), "ping"]
        for _ in range(100):
            out = subprocess.run(cli, capture_output=True, text=True,
                                 env={"REDISCLI_AUTH": PASSWORD, "PATH": "/usr/bin:/bin"})
            if out.stdout.strip() == "PONG":
                break
            assert proc.poll() is None, (tmp_path / "redis.log").read_text()
            time.sleep(0.1)
        assert out.stdout.strip() == "PONG"
        noauth = subprocess.run(cli, capture_output=True, text=True)
        assert "NOAUTH" in noauth.stdout + noauth.stderr
        argv = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
        assert PASSWORD not in argv

        # The registry as rendered, with its mounted files written here.
        url = _secret(docs, f"{FULLNAME}-registry-store", "url")
        (tmp_path / "url").write_text(url.replace(f"{FULLNAME}-redis", "127.0.0.1"))
        (tmp_path / "token").write_text(_secret(docs, f"{FULLNAME}-registry-token", "token"))
        argv = pdserve_argv(main_container(tier(docs, "registry")))
        files = {"/etc/pdserve/registry-store/url": str(tmp_path / "url"),
                 "/etc/pdserve/registry-token/token": str(tmp_path / "token")}
        argv = [files.get(a, a) for a in argv]
        argv[argv.index("--port") + 1] = "0"
        argv[argv.index("--host") + 1] = "127.0.0.1"
        argv += ["--port-file", str(tmp_path / "registry.port")]
        with running(pdserve(*argv), tmp_path / "registry.log") as reg:
            base = serving_url(tmp_path / "registry.port", reg, tmp_path / "registry.log",
                               "/readyz")
            r = httpx.get(f"{base}/readyz", timeout=5).json()
            assert r["store"] == "redis", r


def _autoscaler_metrics(docs, role: str) -> set[str]:
    names = set()
    for d in docs:
        if d["metadata"]["name"] != f"{FULLNAME}-{role}":
            continue
        if d["kind"] == "HorizontalPodAutoscaler":
            names |= {m["pods"]["metric"]["name"] for m in d["spec"]["metrics"]}
        elif d["kind"] == "ScaledObject":
            for t in d["spec"]["triggers"]:
                names |= set(re.findall(r"\bpdserve_[a-z0-9_]+", t["metadata"]["query"]))
    return names


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory) -> dict[str, set[str]]:
    """Sample names at /metrics of a real prefill node (with HiCache), decode node and
    router (tiny-llama, tcp), after one request went through them."""
    tmp = tmp_path_factory.mktemp("m")
    roles = ("prefill", "decode", "router")
    logs = {role: tmp / f"{role}.log" for role in ("registry", *roles)}
    files = {role: tmp / f"{role}.port" for role in logs}

    def where(role: str) -> tuple[str, ...]:  # every server picks its port and reports it
        return ("--port", "0", "--port-file", str(files[role]))

    out: dict[str, set[str]] = {}
    with running(pdserve("registry", *where("registry")), logs["registry"]) as reg:
        registry = serving_url(files["registry"], reg, logs["registry"], "/readyz")
        node = ("--model", "tiny-llama", "--registry", registry, "--transfer-backend", "tcp")
        with running(pdserve("prefill", *node, *where("prefill"),
                             "--enable-hierarchical-cache"), logs["prefill"]) as p, \
             running(pdserve("decode", *node, *where("decode")), logs["decode"]) as d, \
             running(pdserve("router", "--registry", registry, *where("router"), "--model",
                             "tiny-llama", "--registry-poll-s", "0.2"), logs["router"]) as r:
            procs = {"prefill": p, "decode": d, "router": r}
            urls = {role: serving_url(files[role], proc, logs[role],
                                      "/health" if role == "router" else "/readyz")
                    for role, proc in procs.items()}
            for _ in range(100):  # the router sees both nodes, then one request goes through
                ok = httpx.post(f"{urls['router']}/generate", timeout=60, json={
                    "text": "hello", "sampling_params": {"max_new_tokens": 4}})
                if ok.status_code == 200:
                    break
                time.sleep(0.2)
            assert ok.status_code == 200, ok.text
            time.sleep(0.6)  # node stats refresh every 0.25 s
            for role, url in urls.items():
                text = httpx.get(f"{url}/metrics", timeout=10).text
                out[role] = set(re.findall(r"^(pdserve_[a-z0-9_]+)", text, re.M))
    return out


@pytest.mark.parametrize("kind", ["hpa", "keda"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_autoscaler_metrics_are_exported_by_live_nodes(render, live_metrics, kind, role):
    docs = render(None, {f"autoscaling.{role}.enabled": "true",
                         f"autoscaling.{role}.kind": f'"{kind}"'})
    wanted = _autoscaler_metrics(docs, role)
    assert wanted, f"no autoscaler metric for {role} ({kind})"
    missing = wanted - live_metrics[role]
    assert not missing, f"{role} nodes do not export {missing}; they do {live_metrics[role]}"


@pytest.mark.parametrize("metric", ["pdserve_num_requests_running", "pdserve_pd_queue_length"])
def test_documented_alternative_metrics_are_exported_too(render, live_metrics, metric):
    """values.yaml names these as choices for autoscaling.<tier>.metric."""
    docs = render(None, {"autoscaling.decode.enabled": "true",
                         "autoscaling.decode.metric": f'"{metric}"'})
    assert _autoscaler_metrics(docs, "decode") <= live_metrics["decode"]


def _queries(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_metrics_live_processes_export(render, live_metrics):
    """The Grafana dashboard ConfigMap carries Grafana's sidecar label, and every metric
    its PromQL names is one a live prefill node, decode node or router exports."""
    docs = render(None, {"metrics.grafanaDashboard.enabled": "true",
                         "metrics.serviceMonitor.enabled": "true"})
    cm = get(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["pdserve.json"])
    queries = _queries(dashboard)
    names = set(re.findall(r"\bpdserve_[a-z0-9_]+", " ".join(queries)))
    exported = set().union(*live_metrics.values())
    assert len(names) >= 20, names
    assert not names - exported, f"not exported by any live process: {names - exported}"
    for role in ("prefill", "decode", "router"):  # each tier has panels of its own
        assert names & live_metrics[role], role
    # The per-tier panels group by the label the chart's ServiceMonitor sets.
    if any("by (tier" in q or "tier)" in q for q in queries):
        monitor = get(docs, "ServiceMonitor", FULLNAME)
        labels = {r["targetLabel"] for e in monitor["spec"]["endpoints"]
                  for r in e.get("relabelings", [])}
        assert "tier" in labels
    assert all(p.get("datasource", {}).get("uid") == "${datasource}"
               for p in dashboard["panels"] if p["type"] != "row")
