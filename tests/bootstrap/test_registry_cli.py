"""`pdserve registry` flags: all listed, bad input refused with a message, light import."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import httpx
import pytest
from registry_harness import ENTRY, PDSERVE_ENTRY, REPO, Registry

from bootstrap import cli
from bootstrap.config import RegistryConfig
from pdserve.http.limits import HttpLimits
from pdserve.ports import wait_port_file


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_help_lists_every_knob(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["registry", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--port-file",
        "--store",
        "--store-file",
        "--key-prefix",
        "--token",
        "--token-file",
        "--token-reads",
        "--default-ttl",
        "--min-ttl",
        "--max-ttl",
        "--max-body-bytes",
        "--log-level",
    ):
        assert flag in text, flag


def test_flags_map_onto_the_config(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    args = _parser().parse_args(
        [
            "registry",
            "--port",
            "9000",
            "--store",
            "redis://h:1/2",
            "--token-file",
            str(token_file),
            "--token-reads",
            "--default-ttl",
            "6",
            "--max-body-bytes",
            "2048",
        ]
    )
    assert args.func is cli.run
    config = cli.config_from_args(args)
    assert config == RegistryConfig(
        port=9000,
        store="redis://h:1/2",
        token="from-file",
        token_reads=True,
        default_ttl_s=6.0,
        http=HttpLimits(max_body_bytes=2048, max_connections=1024),  # the registry's default
    )


def test_store_url_from_a_file(tmp_path) -> None:
    """The chart mounts the Redis URL (password inside) as a file: never in argv."""
    url_file = tmp_path / "url"
    url_file.write_text("redis://:pw@h:1/2\n")
    args = _parser().parse_args(["registry", "--store-file", str(url_file)])
    assert cli.config_from_args(args).store == "redis://:pw@h:1/2"
    with pytest.raises(SystemExit):  # one or the other
        _parser().parse_args(["registry", "--store", "redis://h:1/0", "--store-file",
                              str(url_file)])


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--store", "mysql://x"], "--store"),
        (["--token-reads"], "--token-reads needs --token"),
        (["--token", ""], "--token must not be empty"),
        (["--min-ttl", "5", "--default-ttl", "2"], "--min-ttl"),
        (["--max-body-bytes", "1"], "--max-body-bytes"),
        (["--port", "99999"], "--port"),
        (["--token-file", "/nonexistent/token"], "--token-file"),
        (["--store-file", "/nonexistent/url"], "--store-file"),
    ],
)
def test_bad_config_is_refused_with_a_message(argv, fragment, capsys) -> None:
    assert cli.run(_parser().parse_args(["registry", *argv])) == 2
    assert fragment in capsys.readouterr().err


def test_unreachable_redis_fails_fast(capsys) -> None:
    args = _parser().parse_args(["registry", "--store", "redis://127.0.0.1:1/0"])
    assert cli.run(args) == 1
    assert "cannot use store" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--port", "abc"], ["--log-level", "loud"], ["--bogus"]])
def test_malformed_flags_exit_nonzero(argv) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["registry", *argv])
    assert info.value.code == 2


def test_pdserve_registry_command_serves(tmp_path) -> None:
    registry = Registry(["--token", "t"], tmp_path, entry=PDSERVE_ENTRY)
    try:
        registry.start(timeout_s=60)  # `pdserve` loads every subcommand: allow for torch
        assert httpx.get(f"{registry.url}/health").json() == {"status": "ok", "store": "memory"}
        proc = subprocess.run(  # a second registry on the same port fails, non-zero
            [*ENTRY, "--port", str(registry.port)], cwd=REPO, capture_output=True, timeout=30
        )
        assert proc.returncode != 0
    finally:
        registry.stop()


def test_client_and_cli_import_no_heavy_modules() -> None:
    code = (
        "import sys, bootstrap.cli, bootstrap.client; "
        "heavy = {'torch', 'fastapi', 'uvicorn', 'pdserve.engine'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=30)


def test_port_0_serves_on_the_port_it_writes_to_the_port_file(tmp_path) -> None:
    """--port 0 --port-file: the registry binds a port the OS picks, serves on it, and
    reports the same number in its one `listening on` line and in the file."""
    port_file, log = tmp_path / "registry.port", tmp_path / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*ENTRY, "--port", "0", "--port-file", str(port_file)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        port = wait_port_file(port_file, proc, 30)
        assert port_file.read_text() == f"{port}\n"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        logged = re.findall(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())
        assert logged == [str(port)], log.read_text()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_server_that_dies_before_its_port_file_fails_fast(tmp_path) -> None:
    proc = subprocess.Popen([*ENTRY, "--port", "0", "--port-file", str(tmp_path / "p"),
                             "--store", "redis://127.0.0.1:1/0"], cwd=REPO,
                            stderr=subprocess.DEVNULL)
    with pytest.raises(RuntimeError, match="exited with 1 before writing its port"):
        wait_port_file(tmp_path / "p", proc, 30)


def test_an_unwritable_port_file_is_refused_before_start(tmp_path) -> None:
    out = subprocess.run([*ENTRY, "--port", "0", "--port-file", str(tmp_path / "no" / "p")],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"--port-file {tmp_path / 'no' / 'p'}: folder" in out.stderr
    assert "Traceback" not in out.stderr
