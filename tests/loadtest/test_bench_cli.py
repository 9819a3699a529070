"""`pdserve bench` flags: every knob in --help, bad input -> message and exit code != 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser, main
from pdserve.loadtest.config import FLAG_GROUPS, BenchConfig

FLAGS = ("--base-url", "--backend", "--dataset-name", "--dataset-path", "--num-prompts",
         "--random-input-len", "--random-output-len", "--random-range-ratio",
         "--request-rate", "--burstiness", "--max-concurrency", "--seed", "--ignore-eos",
         "--warmup-requests", "--goodput", "--percentiles", "--output-file", "--label",
         "--plot", "--sweep-rates", "--tokenizer", "--model", "--endpoint",
         "--request-timeout", "--temperature", "--sharegpt-output-len", "--gsp-num-groups",
         "--gsp-system-prompt-len", "--gsp-question-len", "--gsp-output-len",
         "--save-detailed", "--disable-tqdm", "--json-schema", "--trace-breakdown",
         "--trace-receiver-host", "--trace-receiver-port", "--trace-wait-s")


def parse(*argv: str) -> BenchConfig:
    return BenchConfig.from_cli(build_parser().parse_args(["bench", *argv]))


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for flag in FLAGS:
        assert flag in out, flag
    assert "compare" in out


def test_every_config_field_has_a_flag() -> None:
    from dataclasses import fields

    for f in fields(BenchConfig):
        assert "--" + f.name.replace("_", "-") in FLAGS, f.name
    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in fields(BenchConfig))


def test_help_shows_the_config_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: http://127.0.0.1:30000)", "(default: inf)",
                  "(default: 50,90,99)", "(0: unbounded) (default: 0)", "(default: 1000)"):
        assert shown in out, shown


def test_flags_map_onto_the_config() -> None:
    cfg = parse("--backend", "openai-chat", "--request-rate", "8", "--burstiness", "0.5",
                "--goodput", "ttft:500", "tpot:50", "--percentiles", "50,99.9",
                "--sweep-rates", "1,2,inf", "--no-ignore-eos", "--max-concurrency", "4",
                "--label", "pd")
    assert cfg.backend == "openai-chat" and cfg.request_rate == 8.0 and cfg.burstiness == 0.5
    assert cfg.slos_ms() == {"ttft": 500.0, "tpot": 50.0}
    assert cfg.percentiles == (50.0, 99.9)
    assert cfg.sweep_rates == (1.0, 2.0, float("inf")) and cfg.rates() == cfg.sweep_rates
    assert cfg.ignore_eos is False and cfg.max_concurrency == 4 and cfg.run_label == "pd"
    assert cfg.url == "http://127.0.0.1:30000/v1/chat/completions"
    defaults = parse()
    assert defaults == BenchConfig()  # one set of defaults: the dataclass's
    assert defaults.request_rate == float("inf") and defaults.ignore_eos is True
    assert defaults.rates() == (float("inf"),) and defaults.max_concurrency == 0
    assert defaults.percentiles == (50.0, 90.0, 99.0) and defaults.slos_ms() == {}


@pytest.mark.parametrize(("argv", "message"), [
    (["--request-rate", "fast"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--burstiness", "0"], "--burstiness"),
    (["--goodput", "ttft=5"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--goodput", "ttft:-1"], "> 0 ms"),
    (["--percentiles", "50,101"], "--percentiles"),
    (["--sweep-rates", "1,x"], "--sweep-rates"),
    (["--sweep-rates", "1,0"], "--sweep-rates"),
    (["--percentiles", "50,x"], "--percentiles"),
    (["--percentiles", ","], "--percentiles"),
    (["--goodput", "ttft:inf"], "--goodput"),
    (["--num-prompts", "many"], "--num-prompts"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--random-range-ratio", "1.0"], "--random-range-ratio"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent.json"], "no such file"),
    (["--base-url", "localhost:30000"], "--base-url"),
    (["--plot", "out.svg"], "--plot"),
    (["--max-concurrency", "-1"], "--max-concurrency"),
])
def test_bad_input_is_a_clear_error(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    # A value argparse cannot convert exits from parse_args; a ConfigError, from run().
    try:
        code = main(["bench", *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "pdserve bench: error:" in err and message in err


def test_argparse_level_errors_exit_nonzero() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--backend", "grpc"])
    assert exc.value.code != 0


def test_compare_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", str(tmp_path / "missing.jsonl")]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["bench", "compare", str(empty)]) == 2
    assert main(["bench", "compare", str(empty), "--plot", "x.jpg"]) == 2
    captured = capsys.readouterr()
    assert captured.out.count("error") + captured.err.count("error") == 3


def test_loadtest_never_imports_torch() -> None:
    # Only our modules: other subcommands' imports are their owners' business.
    code = ("import sys, pdserve.loadtest.cli;"
            "import pdserve.loadtest.runner, pdserve.loadtest.report, pdserve.loadtest.compare,"
            " pdserve.loadtest.plots, pdserve.loadtest.tokenizer;"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_flags_type_metadata_converts_a_comma_list() -> None:
    # pdserve/flags.py: `opt(..., type=comma_list(float))`, shared by every CLI.
    import argparse
    from dataclasses import dataclass

    from pdserve.flags import add_dataclass_flags, comma_list, opt, values_from

    @dataclass(frozen=True)
    class Toy:
        rates: tuple[float, ...] = opt((1.0, 2.0), "rates", type=comma_list(float))

    p = argparse.ArgumentParser(exit_on_error=False)
    add_dataclass_flags(p, Toy, "toy")
    assert Toy(**values_from(Toy, p.parse_args([]))) == Toy()
    assert values_from(Toy, p.parse_args(["--rates", "3, inf,"])) == {
        "rates": (3.0, float("inf"))}
    with pytest.raises(argparse.ArgumentError, match="comma-separated float"):
        p.parse_args(["--rates", "1,x"])
