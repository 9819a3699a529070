"""`helm lint --strict`, kubernetes-validate --strict on every rendered value set, every value
in values.yaml used, and scripts/helm_check.sh itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import helm_tool
import pytest
import yaml

VALUE_SETS = sorted(helm_tool.value_sets())

# Values that only matter once another value switches their feature on.
PREREQUISITES = {
    "rdma.": {"rdma.enabled": "true"},
    "router.ingress.": {"router.ingress.enabled": "true"},
    "redis.persistence.": {"redis.persistence.enabled": "true"},
    "metrics.serviceMonitor.": {"metrics.serviceMonitor.enabled": "true"},
    "externalRedis.": {"redis.enabled": "false"},
    "model.mountPath": {"model.volume": '{"emptyDir": {}}'},
    "model.readOnly": {"model.volume": '{"emptyDir": {}}'},
    "redis.pdb.": {"redis.pdb.enabled": "true"},
    "router.ingress.sse.": {"router.ingress.enabled": "true"},
    "autoscaling.prefill.": {"autoscaling.prefill.enabled": "true"},
    "autoscaling.decode.": {"autoscaling.decode.enabled": "true"},
    "autoscaling.keda.": {"autoscaling.decode.enabled": "true",
                          "autoscaling.decode.kind": '"keda"'},
}
# Values with a closed set of choices: the other choice (any other string fails the render).
CHOICES = {"autoscaling.prefill.kind": "keda", "autoscaling.decode.kind": "keda",
           "model.loadFormat": "dummy"}
# A fixed token, so that renders compare equal (the default one is random).
BASE = {"registry.auth.token": '"fixed"'}


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint_strict(helm, values):
    res = helm_tool.lint(helm, helm_tool.value_sets()[values])
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("values", VALUE_SETS)
def test_kubernetes_validate_strict(render_text, kv_cmd, values):
    res = helm_tool.validate(render_text(values), kv_cmd)
    assert res.returncode == 0, res.stdout + res.stderr


def test_kubernetes_validate_rejects_a_bad_manifest(render_text, kv_cmd):
    """The validator is really strict: an unknown field fails it."""
    bad = render_text("default").replace("containerPort: 8000",
                                         "containerPort: 8000\n              bogus: 1", 1)
    assert bad != render_text("default")
    assert helm_tool.validate(bad, kv_cmd).returncode != 0


def leaves(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, val in tree.items():
        path = f"{prefix}{key}"
        if isinstance(val, dict) and val:
            out += leaves(val, path + ".")
        else:
            out.append((path, val))
    return out


def mutated(value: object) -> object:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [] if value else ["x"]
    if isinstance(value, dict):
        return {"example": "x"}
    raise AssertionError(f"unexpected value {value!r}")


def test_every_value_is_used(helm):
    """Changing any leaf of values.yaml changes the rendered manifests."""
    defaults = yaml.safe_load((helm_tool.CHART / "values.yaml").read_text())
    cases = []
    for key, value in leaves(defaults):
        pre = {}
        for prefix, extra in PREREQUISITES.items():
            if key.startswith(prefix) and key not in extra:
                pre.update(extra)
        cases.append((key, value, {**BASE, **pre}))

    workers = min(8, (os.cpu_count() or 2) * 2)
    bases = {tuple(sorted(b.items())) for _, _, b in cases}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        before = dict(zip(bases, pool.map(lambda b: helm_tool.render(helm, None, dict(b)),
                                          bases), strict=True))

        def check(case: tuple[str, object, dict]) -> str | None:
            key, value, base = case
            changed = CHOICES[key] if key in CHOICES else mutated(value)
            after = helm_tool.render(helm, None, {**base, key: json.dumps(changed)})
            return None if before[tuple(sorted(base.items()))] != after else key

        unused = [k for k in pool.map(check, cases) if k]
    assert not unused, f"values with no effect on the chart: {unused}"


def test_helm_check_script_passes():
    res = subprocess.run(["bash", str(helm_tool.REPO / "scripts" / "helm_check.sh")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHON": sys.executable})
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(VALUE_SETS)}/{len(VALUE_SETS)} value sets pass" in res.stdout


def test_values_schema_is_current_and_refuses_typos(helm):
    """values.schema.json is what scripts/helm_schema.py makes of values.yaml, and helm
    refuses a misspelt key or a mistyped value instead of ignoring it."""
    repo = helm_tool.REPO
    check = subprocess.run([sys.executable, str(repo / "scripts" / "helm_schema.py"),
                            "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for overrides, needle in (({"prefill.replica": "3"}, "replica"),
                              ({"kvStore.enabled": '"yes"'}, "enabled"),
                              ({"decode.hicache.ratio": '"two"'}, "ratio")):
        with pytest.raises(subprocess.CalledProcessError) as err:
            helm_tool.render(helm, None, overrides)
        assert needle in err.value.stderr, err.value.stderr
    # Kubernetes pass-through objects stay free-form.
    assert helm_tool.render(helm, None, {"prefill.resources.limits.example/gpu": "1",
                                         "prefill.nodeSelector.zone": '"a"'})
