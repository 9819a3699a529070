"""`pdserve bench` (a load test) and `pdserve bench compare` (runs side by side).

Flags follow `vllm bench serve` / SGLang `bench_serving`; each is one `BenchConfig` field
(its default and help live there; pdserve/flags.py turns the fields into flags). Imported
by `pdserve.cli` for every command, so only argparse and the config load here; httpx,
numpy, tqdm and matplotlib load inside `run`.
"""

from __future__ import annotations

import argparse
import copy
import sys

from pdserve.loadtest.config import BenchConfig, ConfigError


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones ('' / None / False), whose help says what they
    mean; a list default as the comma-separated value its flag takes (50,90,99)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        d = action.default
        if d is None or d is False or d == "" or d is argparse.SUPPRESS:  # 0 still shows
            return action.help
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, (list, tuple)):
            action = copy.copy(action)
            action.default = ",".join(f"{v:g}" if isinstance(v, float) else str(v)
                                      for v in action.default)
        return super()._expand_help(action)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="load-test a server (TTFT/TPOT/ITL/E2EL, goodput, sweeps, plots)",
        description="Load test in the dialect of `vllm bench serve` / SGLang bench_serving. "
        "`pdserve bench compare A.jsonl B.jsonl ... [--plot F.png]` compares saved runs.",
        formatter_class=_Help)
    BenchConfig.add_cli_args(p)
    actions = p.add_subparsers(dest="bench_action", metavar="{compare}")
    cmp = actions.add_parser("compare", help="compare JSONL results side by side",
                             formatter_class=_Help)
    cmp.add_argument("files", nargs="+", metavar="FILE.jsonl", help="results of `pdserve bench`")
    cmp.add_argument("--plot", dest="compare_plot", default="", metavar="F.png",
                     help="also write F.png (TTFT vs TPOT) and F_cdf.png (CDFs)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_action", None) == "compare":
        return _compare(args)
    try:
        cfg = BenchConfig.from_cli(args)
    except ConfigError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    return _bench(cfg)


def _compare(args: argparse.Namespace) -> int:
    if args.compare_plot and not args.compare_plot.lower().endswith(".png"):
        print(f"pdserve bench compare: error: --plot {args.compare_plot!r}: expected F.png",
              file=sys.stderr)
        return 2
    from pdserve.loadtest.compare import run_compare

    return run_compare(args.files, args.compare_plot)


def _bench(cfg: BenchConfig) -> int:
    import asyncio

    from pdserve.loadtest import report
    from pdserve.loadtest.runner import BenchError, RunOutcome, bench

    rows: list[dict] = []

    def on_run(outcome: RunOutcome) -> None:
        rows.append(report.result_row(outcome))
        print(report.format_table(rows[-1]), flush=True)
        if "trace_hops" in rows[-1]:
            from pdserve.loadtest.trace_breakdown import format_breakdown

            print(format_breakdown(rows[-1]["trace_hops"]), flush=True)
        if cfg.output_file:
            report.append_jsonl(cfg.output_file, rows[-1])

    try:
        asyncio.run(bench(cfg, on_run))
    except BenchError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # runs that finished are already printed and saved
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130
    return _finish(cfg, rows)


def _finish(cfg: BenchConfig, rows: list[dict]) -> int:
    from pdserve.loadtest import report

    if len(rows) > 1:
        print("\n" + report.format_runs(rows))
    if cfg.output_file:
        print(f"results appended to {cfg.output_file}")
    if cfg.plot:
        from pdserve.loadtest.plots import cdf_path, write_plots

        write_plots(rows, cfg.plot)
        print(f"plots: {cfg.plot}, {cdf_path(cfg.plot)}")
    # Failures are reported, not fatal; a bench where nothing succeeded still exits non-zero.
    return 0 if any(r["completed"] for r in rows) else 1
