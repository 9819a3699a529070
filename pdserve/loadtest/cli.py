"""`pdserve bench` (a load test) and `pdserve bench compare` (runs side by side).

Flags follow `vllm bench serve` / SGLang `bench_serving`; each maps to one `BenchConfig`
field. Imported by `pdserve.cli` for every command, so only argparse and the config load
here; httpx, numpy, tqdm and matplotlib load inside `run`.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.loadtest.config import BACKENDS, DATASETS, BenchConfig, ConfigError

_D = BenchConfig()


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones ('' / None / False), whose help says what they mean."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        d = action.default
        if d is None or d is False or d == "" or d is argparse.SUPPRESS:  # 0 still shows
            return action.help
        return super()._get_help_string(action)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="load-test a server (TTFT/TPOT/ITL/E2EL, goodput, sweeps, plots)",
        description="Load test in the dialect of `vllm bench serve` / SGLang bench_serving. "
        "`pdserve bench compare A.jsonl B.jsonl ... [--plot F.png]` compares saved runs.",
        formatter_class=_Help)
    _target_flags(p.add_argument_group("target"))
    _dataset_flags(p.add_argument_group("dataset"))
    _load_flags(p.add_argument_group("load"))
    _output_flags(p.add_argument_group("results"))
    actions = p.add_subparsers(dest="bench_action", metavar="{compare}")
    cmp = actions.add_parser("compare", help="compare JSONL results side by side",
                             formatter_class=_Help)
    cmp.add_argument("files", nargs="+", metavar="FILE.jsonl", help="results of `pdserve bench`")
    cmp.add_argument("--plot", dest="compare_plot", default="", metavar="F.png",
                     help="also write F.png (TTFT vs TPOT) and F_cdf.png (CDFs)")
    p.set_defaults(func=run)
    return p


def _target_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--base-url", default=_D.base_url, help="server to load (node or router)")
    g.add_argument("--backend", default=_D.backend, choices=BACKENDS,
                   help="generate: POST /generate (token ids); openai: /v1/completions; "
                   "openai-chat: /v1/chat/completions")
    g.add_argument("--endpoint", default=_D.endpoint, help="override the backend's URL path")
    g.add_argument("--model", default=_D.model,
                   help="model name sent to OpenAI endpoints (default: first of /v1/models)")
    g.add_argument("--tokenizer", default=_D.tokenizer,
                   help="local HF folder or built-in model name (default: the served model "
                   "when it is a local folder or a cached built-in)")
    g.add_argument("--request-timeout", type=float, default=_D.request_timeout,
                   help="seconds before one request counts as failed")


def _dataset_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dataset-name", default=_D.dataset_name, choices=DATASETS,
                   help="random token ids, ShareGPT conversations, or shared-prefix groups")
    g.add_argument("--dataset-path", default=_D.dataset_path,
                   help="ShareGPT-format JSON (a list of {conversations: [{from, value}...]})")
    g.add_argument("--num-prompts", type=int, default=_D.num_prompts,
                   help="requests per run (all datasets)")
    g.add_argument("--random-input-len", type=int, default=_D.random_input_len,
                   help="random: mean prompt tokens")
    g.add_argument("--random-output-len", type=int, default=_D.random_output_len,
                   help="random: mean output tokens")
    g.add_argument("--random-range-ratio", type=float, default=_D.random_range_ratio,
                   help="lengths uniform in [L*(1-r), L*(1+r)] (as vLLM)")
    g.add_argument("--sharegpt-output-len", type=int, default=_D.sharegpt_output_len,
                   help="fixed output length for ShareGPT (0: the reference reply's length)")
    g.add_argument("--gsp-num-groups", type=int, default=_D.gsp_num_groups,
                   help="shared-prefix: groups; prompt i joins group i %% groups")
    g.add_argument("--gsp-system-prompt-len", type=int, default=_D.gsp_system_prompt_len,
                   help="shared-prefix: tokens of each group's shared prefix")
    g.add_argument("--gsp-question-len", type=int, default=_D.gsp_question_len,
                   help="shared-prefix: tokens of each prompt's own suffix")
    g.add_argument("--gsp-output-len", type=int, default=_D.gsp_output_len,
                   help="shared-prefix: output tokens per request")


def _load_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--request-rate", default="inf",
                   help="requests/s ('inf': all at once)")
    g.add_argument("--burstiness", type=float, default=_D.burstiness,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: unbounded)")
    g.add_argument("--sweep-rates", default="",
                   help="comma-separated rates, one run each (overrides --request-rate)")
    g.add_argument("--seed", type=int, default=_D.seed, help="seeds prompts and arrivals")
    g.add_argument("--warmup-requests", type=int, default=_D.warmup_requests,
                   help="untimed requests sent before the runs")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction,
                   default=_D.ignore_eos, help="generate exactly the requested output length")
    g.add_argument("--temperature", type=float, default=_D.temperature, help="0: greedy")
    g.add_argument("--json-schema", default=_D.json_schema, metavar="FILE",
                   help="constrain every output to this JSON schema (structured output: "
                        "response_format, or sampling_params.json_schema on /generate)")


def _output_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    g.add_argument("--percentiles", default="50,90,99", help="percentiles to report")
    g.add_argument("--output-file", default=_D.output_file,
                   help="append one JSON line per run to this file")
    g.add_argument("--label", default=_D.label, help="name of this configuration "
                   "(default: the backend); plots draw one curve per label")
    g.add_argument("--plot", default=_D.plot, metavar="F.png",
                   help="write F.png (TTFT vs TPOT over the runs) and F_cdf.png (CDFs)")
    g.add_argument("--save-detailed", action="store_true",
                   help="also store per-request ITLs, start times and generated texts")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_action", None) == "compare":
        return _compare(args)
    try:
        cfg = BenchConfig.from_args(args)
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
