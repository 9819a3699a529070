"""`pdserve up` and `pdserve demo` as processes: SIGTERM stops every child of `up` (a
stack of its own: the session's shared one must outlive every other test, in any order),
`demo` runs its load test and leaves nothing behind, and a taken --port is a clear error
before anything starts."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import httpx
import pytest
from router_harness import BACKEND, REPO, Up, group_alive, pdserve

from pdserve.cli import build_parser
from pdserve.cpus import split_cores
from pdserve.stack.config import DemoConfig, StackConfig


def test_up_sigterm_stops_every_process(tmp_path):
    stack = Up(tmp_path, 1, 1).start()
    try:
        _nodes_split_the_cores(stack)
        _sigterm_stops_every_process(stack)
    finally:
        stack.stop()


def _nodes_split_the_cores(stack: Up) -> None:
    """Two nodes on one machine: each runs its share of the cores, and `up` says so."""
    want = split_cores(2)
    for name in ("prefill-0", "decode-0"):
        info = httpx.get(stack.urls[name] + "/server_info", timeout=10).json()
        assert info["engine"]["torch_threads"] == want, (name, info["engine"])
    assert f"{want} forward thread(s) each" in stack.output()


def _sigterm_stops_every_process(stack: Up) -> None:
    assert stack.pids.keys() == {"router", "registry", "prefill-0", "decode-0"}
    t0 = time.monotonic()
    assert stack.terminate() == 0, stack.output()[-3000:]
    assert time.monotonic() - t0 < 40
    assert not stack.leftovers(), (stack.leftovers(), stack.child_logs())
    out = stack.output()
    assert "SIGTERM, stopping" in out and "pdserve up: stopped" in out, out[-2000:]
    assert "had to kill" not in out, out[-2000:]


def test_demo_runs_a_load_test_and_leaves_nothing_behind(tmp_path):
    cmd = pdserve("demo", "--model", "tiny-llama", "--num-prompts", "8", "--request-rate",
                  "16", "--input-len", "48", "--output-len", "8", "--transfer-backend", BACKEND,
                  "--log-dir", str(tmp_path / "logs"))
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    text = out.stdout
    assert out.returncode == 0, (text[-4000:], out.stderr[-4000:])
    assert "8/8 requests ok" in text, text[-3000:]
    assert re.search(r"TTFT ms\s+mean\s+\d+", text) and re.search(r"TPOT ms\s+mean\s+\d+",
                                                                    text), text[-3000:]
    assert "pdserve demo: stopped" in text
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
    assert len(pids) == 4, text
    assert not any(group_alive(p) for p in pids)


def test_up_refuses_a_taken_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run(pdserve("up", "--model", "tiny-llama", "--port", str(port),
                                     "--log-dir", str(tmp_path)),
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert f"port {port}" in out.stderr and "already in use" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 30
    assert not list(tmp_path.glob("*.log"))  # nothing was started


def test_every_stack_field_is_a_flag():
    from dataclasses import fields

    sub = build_parser()._subparsers._group_actions[0].choices
    for command, classes in (("up", [StackConfig]), ("demo", [StackConfig, DemoConfig])):
        flags = {o for a in sub[command]._actions for o in a.option_strings}
        for cls in classes:
            for f in fields(cls):
                if f.name != "stack":
                    assert "--" + f.name.replace("_", "-") in flags, (command, f.name)


def test_nodes_on_one_gpu_split_the_memory_fraction(tmp_path):
    """`pdserve up` with nodes on CUDA gives each its share of --mem-fraction-static (they
    share the GPU), unless --node-args sizes the pools; CPU nodes get no such flag."""
    from pdserve.stack.stack import Stack

    def node_cmd(node_args: str, prefill: int = 1, decode: int = 1) -> list[str]:
        cfg = StackConfig(model="tiny-llama", prefill=prefill, decode=decode,
                          node_args=node_args, log_dir=str(tmp_path), transfer_backend="tcp")
        return Stack(cfg, say=lambda *_: None)._node("p0", "prefill").child.cmd

    cmd = node_cmd("--device cuda", prefill=1, decode=3)
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.212"  # 0.85 / 4
    assert "--mem-fraction-static" not in node_cmd("--device cuda --kv-cache-mb=4096")
    assert "--mem-fraction-static" not in node_cmd("--device cpu")


def test_role_args_reach_only_their_role_and_win_over_node_args(tmp_path):
    """--prefill-args / --decode-args go to their role's nodes only, after --node-args (the
    later flag wins in argparse), e.g. HiCache on the prefill tier alone."""
    from pdserve.stack.stack import Stack

    cfg = StackConfig(model="tiny-llama", node_args="--hicache-ratio 3",
                      prefill_args="--enable-hierarchical-cache --hicache-ratio 4",
                      decode_args="--max-running-requests 7", log_dir=str(tmp_path),
                      transfer_backend="tcp")
    stack = Stack(cfg, say=lambda *_: None)
    pre = stack._node("p0", "prefill").child.cmd
    dec = stack._node("d0", "decode").child.cmd
    assert "--enable-hierarchical-cache" in pre and "--enable-hierarchical-cache" not in dec
    assert "--max-running-requests" in dec and "--max-running-requests" not in pre
    ratios = [pre[i + 1] for i, a in enumerate(pre) if a == "--hicache-ratio"]
    assert ratios == ["3", "4"]  # node args first, the role's last
    assert [dec[i + 1] for i, a in enumerate(dec) if a == "--hicache-ratio"] == ["3"]
    with pytest.raises(ValueError, match="--decode-args"):
        StackConfig(model="tiny-llama", decode_args="--x 'unclosed")
