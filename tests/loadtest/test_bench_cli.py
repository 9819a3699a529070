"""`pdserve bench` flags: every knob in --help, bad input -> message and exit code != 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser, main
from pdserve.loadtest.config import BenchConfig

FLAGS = ("--base-url", "--backend", "--dataset-name", "--dataset-path", "--num-prompts",
         "--random-input-len", "--random-output-len", "--random-range-ratio",
         "--request-rate", "--burstiness", "--max-concurrency", "--seed", "--ignore-eos",
         "--warmup-requests", "--goodput", "--percentiles", "--output-file", "--label",
         "--plot", "--sweep-rates", "--tokenizer", "--model", "--endpoint",
         "--request-timeout", "--temperature", "--sharegpt-output-len", "--gsp-num-groups",
         "--gsp-system-prompt-len", "--gsp-question-len", "--gsp-output-len",
         "--save-detailed", "--disable-tqdm", "--json-schema")


def parse(*argv: str) -> BenchConfig:
    return BenchConfig.from_args(build_parser().parse_args(["bench", *argv]))


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


def test_flags_map_onto_the_config() -> None:
    cfg = parse("--backend", "openai-chat", "--request-rate", "8", "--burstiness", "0.5",
                "--goodput", "ttft:500", "tpot:50", "--percentiles", "50,99.9",
                "--sweep-rates", "1,2,inf", "--no-ignore-eos", "--max-concurrency", "4",
                "--label", "pd")
    assert cfg.backend == "openai-chat" and cfg.request_rate == 8.0 and cfg.burstiness == 0.5
    assert cfg.goodput == {"ttft": 500.0, "tpot": 50.0}
    assert cfg.percentiles == (50.0, 99.9)
    assert cfg.sweep_rates == (1.0, 2.0, float("inf")) and cfg.rates() == cfg.sweep_rates
    assert cfg.ignore_eos is False and cfg.max_concurrency == 4 and cfg.run_label == "pd"
    assert cfg.url == "http://127.0.0.1:30000/v1/chat/completions"
    defaults = parse()
    assert defaults.request_rate == float("inf") and defaults.ignore_eos is True
    assert defaults.rates() == (float("inf"),) and defaults.max_concurrency == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--request-rate", "fast"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--burstiness", "0"], "--burstiness"),
    (["--goodput", "ttft=5"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--goodput", "ttft:-1"], "> 0 ms"),
    (["--percentiles", "50,101"], "--percentiles"),
    (["--sweep-rates", "1,x"], "--sweep-rates"),
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
    assert main(["bench", *argv]) == 2
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
