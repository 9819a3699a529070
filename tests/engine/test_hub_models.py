"""Checkpoints as users name them: sharded safetensors streamed into the fused projections,
Hub repository ids (`--model ORG/NAME`) downloaded through `huggingface_hub` from a
loopback Hub (tests/hub_server.py), and `--load-format dummy`.

Hub cases run in a fresh interpreter each, as a node does: `huggingface_hub` reads
HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import COMMIT, HubServer, sharded_copy
from safetensors.torch import load_file, save_file

from pdserve.models.loader import load_model

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


# ---- streamed shard loading (no Hub) -------------------------------------------------------
def test_shards_load_bit_equal_to_the_single_file(tmp_path):
    folder = sharded_copy(tmp_path / "sharded")
    k0 = "model.layers.0.self_attn.k_proj.weight"
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[k0] != index[k0.replace("k_proj", "q_proj")]  # the fused rows span shards
    for dtype in ("float32", "bfloat16"):
        ours = load_model(str(folder), dtype, CPU)
        builtin = load_model("tiny-llama", dtype, CPU)
        assert next(ours.model.parameters()).dtype == getattr(torch, dtype)
        assert same_weights(ours.model, builtin.model)
        assert torch.equal(ours.model.rotary.inv_freq, builtin.model.rotary.inv_freq)


def _edit_shard(folder: Path, edit) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    state = load_file(str(shard))
    edit(state)
    save_file(state, str(shard), metadata={"format": "pt"})


@pytest.mark.parametrize("damage,needle", [
    ("drop", "missing"), ("extra", "unexpected"), ("reshape", "misshapen"),
    ("lose_shard", "shards named by its index are missing"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_by_name(tmp_path, damage, needle):
    folder = sharded_copy(tmp_path / "bad")
    first = sorted(load_file(str(sorted(folder.glob("*.safetensors"))[0])))[0]
    if damage == "drop":
        _edit_shard(folder, lambda s: s.pop(first))
    elif damage == "extra":
        _edit_shard(folder, lambda s: s.update({"model.layers.0.mlp.extra.weight":
                                                torch.zeros(2, 2)}))
    elif damage == "reshape":
        _edit_shard(folder, lambda s: s.update({first: torch.zeros(3, 5)}))
    else:
        sorted(folder.glob("*.safetensors"))[-1].unlink()
    with pytest.raises(ValueError, match=needle) as err:
        load_model(str(folder), "float32", CPU)
    if damage in ("drop", "reshape"):
        assert first.split(".")[-2] in str(err.value) or first in str(err.value)


def test_dummy_weights_have_the_shape_and_are_the_same_on_every_load():
    a = load_model("tiny-llama", "float32", CPU, load_format="dummy")
    b = load_model("tiny-llama", "float32", CPU, load_format="dummy")
    real = load_model("tiny-llama", "float32", CPU)
    assert same_weights(a.model, b.model)  # the prefill and decode nodes of a pair agree
    assert not same_weights(a.model, real.model)
    shapes = {k: v.shape for k, v in real.model.named_parameters()}
    assert {k: v.shape for k, v in a.model.named_parameters()} == shapes
    with pytest.raises(ValueError, match="load_format"):
        load_model("tiny-llama", "float32", CPU, load_format="pt")


# ---- Hub repository ids ---------------------------------------------------------------------
def run_py(code: str, env: dict[str, str], timeout: float = 180) -> dict:
    """Run `code` in a fresh interpreter with `env` added; it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout,
                         env={**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def hub_env(hub: HubServer, tmp: Path, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf"), "HF_TOKEN": "", **extra}


LOAD_AND_COMPARE = """
import json, torch
from pdserve.models.loader import load_model
hub = load_model("acme/tiny-llama", "float32", torch.device("cpu"))
ref = load_model("tiny-llama", "float32", torch.device("cpu"))
pa, pb = dict(hub.model.named_parameters()), dict(ref.model.named_parameters())
print(json.dumps({"path": str(hub.path), "equal": pa.keys() == pb.keys()
                  and all(torch.equal(pa[k], pb[k]) for k in pa)}))
"""

TRY = """
import json
from pdserve.models.builtin import resolve_model
out = {}
for name, kw in CASES:
    try:
        out[name] = "ok " + str(resolve_model(name, **kw))
    except ValueError as exc:
        out[name] = "error " + str(exc)
print(json.dumps(out))
"""


def try_resolve(cases: list[tuple[str, dict]], env: dict[str, str]) -> dict[str, str]:
    return run_py(f"CASES = {cases!r}\n{TRY}", env)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return sharded_copy(tmp_path_factory.mktemp("hub") / "tiny-llama")


def test_a_hub_model_downloads_its_shards_once_and_loads_offline_after(repo, tmp_path):
    with HubServer({"acme/tiny-llama": repo}) as hub:
        got = run_py(LOAD_AND_COMPARE, hub_env(hub, tmp_path))
        fetched = hub.downloads()
    assert got["equal"], "the Hub copy must load bit-equal to the built-in model"
    assert Path(got["path"]).is_relative_to(tmp_path / "hf")  # the Hub cache, HF_HOME
    assert COMMIT in got["path"]
    shards = sorted(f.name for f in repo.glob("*.safetensors"))
    assert sorted(f for f in fetched if f.endswith(".safetensors")) == shards
    # The Hub is gone; HF_HUB_OFFLINE reads the cache, and names a model it lacks clearly.
    offline = hub_env(hub, tmp_path, HF_HUB_OFFLINE="1")
    assert run_py(LOAD_AND_COMPARE, offline)["equal"]
    msg = try_resolve([("acme/other", {})], offline)["acme/other"]
    assert msg.startswith("error") and "local Hub cache" in msg and "HF_HUB_OFFLINE" in msg


def test_tokenizer_only_and_dummy_loads_fetch_no_weights(repo, tmp_path):
    code = """
import json, torch
from pdserve.models.builtin import resolve_model
from pdserve.models.loader import load_model
from pdserve.models.tokenizer import load_tokenizer
path = resolve_model("acme/tiny-llama", weights=False)
tok = load_tokenizer(path)
m = load_model("acme/tiny-llama", "float32", torch.device("cpu"), load_format="dummy")
ref = load_model("tiny-llama", "float32", torch.device("cpu"), load_format="dummy")
pa, pb = dict(m.model.named_parameters()), dict(ref.model.named_parameters())
print(json.dumps({"ids": tok.encode("hello world"), "equal": all(
    torch.equal(pa[k], pb[k]) for k in pa)}))
"""
    with HubServer({"acme/tiny-llama": repo}) as hub:
        got = run_py(code, hub_env(hub, tmp_path))
        fetched = hub.downloads()
    assert got["ids"] and got["equal"]  # dummy weights depend on the shape only
    assert "config.json" in fetched and "tokenizer.json" in fetched
    assert not [f for f in fetched if f.endswith(".safetensors")], fetched


def test_unknown_repositories_and_revisions_are_named_clearly(repo, tmp_path):
    with HubServer({"acme/tiny-llama": repo}) as hub:
        got = try_resolve([("acme/missing", {}),
                           ("acme/tiny-llama", {"revision": COMMIT, "weights": False})],
                          hub_env(hub, tmp_path))
        bad = try_resolve([("acme/tiny-llama", {"revision": "no-such-branch"})],
                          hub_env(hub, tmp_path))
    assert got["acme/missing"].startswith("error") and "not found" in got["acme/missing"]
    assert got["acme/tiny-llama"].startswith("ok")  # the pinned commit resolves
    assert bad["acme/tiny-llama"].startswith("error")
    assert "no-such-branch" in bad["acme/tiny-llama"]


def test_a_private_repository_needs_hf_token(repo, tmp_path):
    # (HF_TOKEN="" is no token: huggingface_hub treats an empty value as unset)
    with HubServer({"acme/private": repo}, token="hf_s3cret") as hub:
        cli = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "serve", "--model", "acme/private",
             "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120,
            env={**os.environ, **hub_env(hub, tmp_path)})
        with_token = try_resolve([("acme/private", {"weights": False})],
                                 hub_env(hub, tmp_path, HF_TOKEN="hf_s3cret"))
    assert cli.returncode != 0
    err = cli.stderr.strip().splitlines()[-1]
    assert "acme/private" in err and "HF_TOKEN" in err and "Traceback" not in cli.stderr
    assert with_token["acme/private"].startswith("ok")
