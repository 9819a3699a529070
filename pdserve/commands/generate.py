"""`pdserve generate`: offline generation with the engine core (a short demo by default)."""

from __future__ import annotations

import argparse
import time

from pdserve.config import EngineConfig

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
]


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="offline generation (default: a short demo)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt (repeatable); default: four demo questions")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-chat-template", action="store_true",
                   help="send prompts raw instead of through the model's chat template")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run, model="smollm2-135m")


def run(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    try:
        cfg = EngineConfig.from_cli(args)
        t0 = time.perf_counter()
        llm = LLM(**vars(cfg))
    except (ValueError, RuntimeError) as exc:
        print(f"pdserve generate: error: {exc}")
        return 2
    print(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s "
          f"({llm.engine.loop_choice.loop} loop, device {llm.engine.device})")
    prompts = args.prompt or DEMO_PROMPTS
    if not args.no_chat_template and llm.tokenizer.chat_template:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                     tokenize=False, add_generation_prompt=True)
                   for p in prompts]
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
    except ValueError as exc:
        print(f"pdserve generate: error: {exc}")
        return 2
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(args.prompt or DEMO_PROMPTS, outs, strict=True):
        print(f"\n>>> {prompt}\n{out.text.strip()}  [{out.finish_reason}]")
    n = sum(len(o.output_ids) for o in outs)
    print(f"\n{len(outs)} requests, {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s)")
    llm.close()
    return 0
