"""The Helm values `pdserve plan --values-out` writes render with the chart (issue 16)."""

from __future__ import annotations

import helm_tool
import yaml
from manifests import flag, main_container, pdserve_argv, tier

from pdserve.plan.helm_values import plan_values, write_values
from pdserve.plan.profile_model import Profile
from pdserve.plan.sim import ClusterSpec


def small_profile() -> Profile:
    return Profile(model="tiny-llama", page_size=16,
                   engine={"chunked_prefill_size": 2048, "max_prefill_tokens": 4096,
                           "max_running_requests": 64, "decode_reserve_tokens": 64,
                           "kv_cache_mb": 512},
                   kv_bytes_per_token=1024, kv_pool_tokens=1 << 16, torch_threads=1,
                   cpu_count=2, transfer_backend="tcp", prefill_coef=[0.01, 0.001, 0.0],
                   decode_coef=[0.02, 0.0, 0.0], transfer_latency_s=0.005, transfer_gbps=1.0)


def test_plan_values_render_replicas_and_node_flags(helm, tmp_path):
    values = plan_values(small_profile(), ClusterSpec(prefill=2, decode=3), "tcp")
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
