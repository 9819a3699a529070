"""Prompt sets: random token ids, ShareGPT conversations, shared-prefix groups.

Lengths follow vLLM's `--random-range-ratio` rule (uniform in [L(1-r), L(1+r)]) so a given
flag set means the same workload here and there. Generators are seeded and pure: the same
config and tokenizer always give the same prompts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.loadtest.config import BenchConfig
from pdserve.loadtest.tokenizer import BenchTokenizer

# Without a tokenizer, random ids come from this range: below most vocabularies' size and
# above the low ids where byte-level vocabularies keep their special/control tokens.
FALLBACK_ID_RANGE = (256, 8192)
# vLLM's ShareGPT filter: drop tiny turns and over-long conversations.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class Prompt:
    prompt_len: int  # tokens, as the dataset counts them (the server's count wins later)
    output_len: int  # max_new_tokens to ask for
    text: str | None = None
    ids: tuple[int, ...] | None = None
    group: int = -1  # shared-prefix group, -1 elsewhere


def build_prompts(cfg: BenchConfig, tok: BenchTokenizer | None) -> list[Prompt]:
    rng = np.random.default_rng([cfg.seed, 0])  # own stream: arrivals don't shift prompts
    if cfg.dataset_name == "random":
        return random_prompts(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                              cfg.random_range_ratio, rng, tok)
    if cfg.dataset_name == "shared-prefix":
        return shared_prefix_prompts(cfg.num_prompts, cfg.gsp_num_groups,
                                     cfg.gsp_system_prompt_len, cfg.gsp_question_len,
                                     cfg.gsp_output_len, rng, tok)
    return sharegpt_prompts(Path(cfg.dataset_path), cfg.num_prompts, cfg.sharegpt_output_len,
                            rng, tok)


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of vLLM's random lengths; never below 1."""
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def id_pool(tok: BenchTokenizer | None) -> np.ndarray:
    if tok is None:
        return np.arange(*FALLBACK_ID_RANGE)
    return np.asarray(tok.normal_ids())


def random_ids(rng: np.random.Generator, pool: np.ndarray, n: int) -> tuple[int, ...]:
    return tuple(int(i) for i in rng.choice(pool, size=n))


def random_prompts(n: int, input_len: int, output_len: int, ratio: float,
                   rng: np.random.Generator, tok: BenchTokenizer | None) -> list[Prompt]:
    in_lo, in_hi = length_range(input_len, ratio)
    out_lo, out_hi = length_range(output_len, ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=n)
    out_lens = rng.integers(out_lo, out_hi + 1, size=n)
    pool = id_pool(tok)
    prompts = []
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        ids = random_ids(rng, pool, int(in_len))
        text = tok.decode(list(ids)) if tok else None
        prompts.append(Prompt(int(in_len), int(out_len), text, ids))
    return prompts


def shared_prefix_prompts(n: int, groups: int, prefix_len: int, question_len: int,
                          output_len: int, rng: np.random.Generator,
                          tok: BenchTokenizer | None) -> list[Prompt]:
    """Prompt i belongs to group i % groups: one random prefix per group + its own question.

    Prompts of a group share the prefix exactly, as ids and as text (see `_joined_text`).
    """
    pool = id_pool(tok)
    prefixes = [random_ids(rng, pool, prefix_len) for _ in range(groups)]
    prefix_texts = [tok.decode(list(p)) for p in prefixes] if tok else []
    prompts = []
    for i in range(n):
        g = i % groups
        ids = prefixes[g] + random_ids(rng, pool, question_len)
        text = _joined_text(tok, ids, prefix_texts[g], prefix_len) if tok else None
        prompts.append(Prompt(prefix_len + question_len, output_len, text, ids, g))
    order = rng.permutation(n)  # interleave groups in time, as SGLang's bench does
    return [prompts[int(i)] for i in order]


def _joined_text(tok: BenchTokenizer, ids: tuple[int, ...], prefix_text: str,
                 prefix_len: int) -> str:
    """Decode the whole prompt, so the boundary decodes as the tokenizer would (spaces);
    if that text does not start with the group's prefix text, glue the two decodings."""
    text = tok.decode(list(ids))
    if text.startswith(prefix_text):
        return text
    return prefix_text + tok.decode(list(ids[prefix_len:]))


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first user turn, the reply) of every conversation with at least two turns."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read ShareGPT file {path}: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        # ShareGPT uses {"from", "value"}; OpenAI-style dumps use {"role", "content"}.
        texts = [t.get("value", t.get("content")) for t in turns[:2]]
        if all(isinstance(t, str) for t in texts):
            pairs.append((texts[0], texts[1]))
    return pairs


def approx_tokens(text: str) -> int:
    """Used only without a tokenizer: ~4 characters per token for English BPE vocabularies."""
    return max(1, round(len(text) / 4))


def sharegpt_prompts(path: Path, n: int, fixed_output_len: int, rng: np.random.Generator,
                     tok: BenchTokenizer | None) -> list[Prompt]:
    count = tok.count if tok else approx_tokens
    pairs = load_sharegpt(path)
    chosen: list[Prompt] = []
    for i in rng.permutation(len(pairs)):
        prompt, reply = pairs[int(i)]
        p_len = count(prompt)
        o_len = fixed_output_len or count(reply)
        too_short = p_len < SHAREGPT_MIN_LEN or (not fixed_output_len and o_len < SHAREGPT_MIN_LEN)
        if too_short or p_len > SHAREGPT_MAX_PROMPT or p_len + o_len > SHAREGPT_MAX_TOTAL:
            continue
        chosen.append(Prompt(p_len, o_len, prompt))
        if len(chosen) == n:
            return chosen
    if not chosen:
        raise ValueError(f"{path}: no usable conversation (need >= 2 turns within the "
                         f"{SHAREGPT_MAX_PROMPT}/{SHAREGPT_MAX_TOTAL}-token limits)")
    # Fewer usable conversations than --num-prompts: resample, as vLLM's oversampling does.
    extra = rng.choice(len(chosen), size=n - len(chosen))
    return chosen + [chosen[int(i)] for i in extra]
