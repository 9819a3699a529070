"""`pdserve serve --model ORG/NAME`: a node downloads a sharded checkpoint from the Hub
(a loopback stand-in, tests/hub_server.py) into the Hub cache, serves it token-exact, and
advertises the name the user gave."""

from __future__ import annotations

import random

import httpx
from hf_reference import hf_greedy
from hub_server import HubServer, sharded_copy
from server_harness import Server


def test_a_node_serves_a_hub_model_token_exact(tmp_path):
    repo = sharded_copy(tmp_path / "repo")
    with HubServer({"acme/tiny-llama": repo}) as hub:
        server = Server("--model", "acme/tiny-llama", log_dir=tmp_path)
        server.env_extra = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
                            "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1"}
        server.start()
        try:
            assert sum(f.endswith(".safetensors") for f in hub.downloads()) == 3
            models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
            assert [m["id"] for m in models["data"]] == ["acme/tiny-llama"]
            rng = random.Random(3)
            ids = [rng.randrange(100, 30000) for _ in range(40)]
            r = httpx.post(f"{server.url}/generate", timeout=120, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}})
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == list(hf_greedy("tiny-llama", tuple(ids), 8))
            server.wait_pools_full()
        finally:
            rc = server.terminate()
    assert rc == 0, server.log()[-3000:]
