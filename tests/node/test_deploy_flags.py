"""Deployment flags of nodes and the router, without processes: tokens from files,
--advertise-host, IPv6 addresses bracketed in the registered URL, drain settings, and the
drain wait itself (the live drain is tests/router/test_router_drain.py)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from bootstrap.record import NodeRegistration
from pdserve.flags import ConfigError
from pdserve.netaddr import http_url, url_host
from pdserve.node.config import ServerConfig
from pdserve.node.drain import wait_drained
from pdserve.node.registration import node_record
from pdserve.pd.config import PDConfig
from pdserve.router.config import RouterConfig

KV = {"kv_endpoint": "h:1", "transfer_backend": "tcp", "model": "m", "page_size": 16,
      "kv_layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"}}


def _pd(*argv: str, host: str = "127.0.0.1") -> PDConfig:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default=host)
    PDConfig.add_cli_args(p)
    return PDConfig.from_cli(p.parse_args(["--registry", "http://r:8998", *argv]))


def _router(*argv: str) -> RouterConfig:
    p = argparse.ArgumentParser()
    RouterConfig.add_cli_args(p)
    return RouterConfig.from_cli(p.parse_args(list(argv)))


def test_url_host_brackets_ipv6_only():
    assert url_host("10.0.0.1") == "10.0.0.1" and url_host("pd-0.svc") == "pd-0.svc"
    assert url_host("fd00::1") == "[fd00::1]" and url_host("[fd00::1]") == "[fd00::1]"
    assert http_url("fd00::1", 30001) == "http://[fd00::1]:30001"


def test_registry_token_file(tmp_path: Path):
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert _pd("--registry-token-file", str(f)).registry_token == "s3cret"
    assert _router("--registry-token-file", str(f)).registry_token == "s3cret"
    assert _pd("--registry-token", "argv").registry_token == "argv"  # old flag still works
    (tmp_path / "empty").write_text("  \n")
    for bad, why in ((tmp_path / "missing", "No such file"), (tmp_path / "empty", "empty")):
        with pytest.raises(ValueError, match=why):
            _pd("--registry-token-file", str(bad))
        with pytest.raises(ValueError, match=why):
            _router("--registry-token-file", str(bad))


def _node(*argv: str) -> ServerConfig:
    p = argparse.ArgumentParser()
    ServerConfig.add_cli_args(p)
    PDConfig.add_cli_args(p)
    return ServerConfig.from_cli(p.parse_args(["--registry", "http://r:8998", *argv]),
                                 "decode")


def test_wildcard_host_needs_advertise_host():
    with pytest.raises(ConfigError, match="--advertise-host"):
        _node("--host", "0.0.0.0")
    cfg = _node("--advertise-host", "10.1.2.3", "--host", "0.0.0.0")
    assert cfg.pd.advertise_host == "10.1.2.3" and cfg.host == "0.0.0.0"


@pytest.mark.parametrize("host,url", [("10.1.2.3", "http://10.1.2.3:30002"),
                                      ("fd00::7", "http://[fd00::7]:30002")])
def test_record_advertises_host_and_the_registry_accepts_it(host: str, url: str):
    cfg = SimpleNamespace(role="decode", host="0.0.0.0", port=30002,
                          pd=_pd("--advertise-host", host, host="0.0.0.0"))
    record = node_record(cfg, SimpleNamespace(kv_info=KV))
    assert record["http_url"] == url and record["node_id"] == f"decode-{host}-30002"
    NodeRegistration.model_validate(record)  # the registry's own schema: no 422


def test_drain_flags():
    cfg = _pd("--drain-timeout-s", "90", "--drain-grace-s", "3")
    assert (cfg.drain_timeout_s, cfg.drain_grace_s) == (90.0, 3.0)
    with pytest.raises(ValueError, match="drain"):
        _pd("--drain-timeout-s", "-1")


def test_wait_drained_waits_for_grace_then_open_requests():
    open_requests = [3]

    async def run(grace: float, timeout: float) -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.create_task(wait_drained(lambda: open_requests[0], grace, timeout,
                                                poll_s=0.01))
        await asyncio.sleep(0.05)
        assert not task.done()  # requests still open
        open_requests[0] = 0
        return await task, loop.time() - t0

    left, _ = asyncio.run(run(0.0, 3600.0))
    assert left == 0  # returned once the requests were done, not at the (hour) timeout
    open_requests[0] = 2
    left, took = asyncio.run(run(0.3, 3600.0))
    assert left == 0 and took >= 0.3  # never before the grace period
    open_requests[0] = 5

    async def stuck() -> int:
        return await wait_drained(lambda: open_requests[0], 0.0, 0.2, poll_s=0.01)

    assert asyncio.run(stuck()) == 5  # gives up after the timeout, reports what is left


def test_stack_registry_token_file(tmp_path: Path):
    from pdserve.cli import build_parser
    from pdserve.stack.config import stack_from_cli

    f = tmp_path / "token"
    f.write_text("stack-token\n")
    args = build_parser().parse_args(["up", "--model", "tiny-llama",
                                      "--registry-token-file", str(f)])
    assert stack_from_cli(args).registry_token == "stack-token"
    args = build_parser().parse_args(["up", "--model", "tiny-llama",
                                      "--registry-token-file", str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="--registry-token-file"):
        stack_from_cli(args)
