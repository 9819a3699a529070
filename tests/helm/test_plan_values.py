"""The Helm values `pdserve plan --values-out` writes render with the chart (issue 16)."""

from __future__ import annotations

import helm_tool
import yaml
from manifests import flag, main_container, pdserve_argv, tier

from pdserve.plan.helm_values import plan_values, write_values
from pdserve.plan.sim import ClusterSpec
from tests.plan.helpers import round_profile


def test_plan_values_render_replicas_and_node_flags(helm, tmp_path):
    values = plan_values(round_profile(), ClusterSpec(prefill=2, decode=3), "tcp")
    path = tmp_path / "values.yaml"
    write_values(path, values, "test")
    docs = [d for d in yaml.safe_load_all(helm_tool.render(helm, path)) if d]
    pre, dec = tier(docs, "prefill"), tier(docs, "decode")
    assert (pre["spec"]["replicas"], dec["spec"]["replicas"]) == (2, 3)
    argv = pdserve_argv(main_container(pre))
    assert flag(argv, "--chunked-prefill-size") == "2048"
    assert flag(argv, "--max-prefill-tokens") == "4096"
    assert flag(argv, "--transfer-backend") == "tcp"
    assert flag(pdserve_argv(main_container(dec)), "--decode-reserve-tokens") == "64"
