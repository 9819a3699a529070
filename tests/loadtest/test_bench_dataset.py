"""Dataset generators: random lengths, shared-prefix groups, ShareGPT loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.loadtest.config import BenchConfig
from pdserve.loadtest.dataset import (
    FALLBACK_ID_RANGE,
    build_prompts,
    length_range,
    random_prompts,
    shared_prefix_prompts,
    sharegpt_prompts,
)
from pdserve.loadtest.tokenizer import load_tokenizer


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_length_range_follows_vllm() -> None:
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(3, 0.9) == (1, 6)  # floor(0.3) would be 0: never below 1


def test_random_lengths_within_range_ratio() -> None:
    prompts = random_prompts(2000, 100, 20, 0.5, rng(), None)
    ins = np.array([p.prompt_len for p in prompts])
    outs = np.array([p.output_len for p in prompts])
    assert ins.min() >= 50 and ins.max() <= 150
    assert outs.min() >= 10 and outs.max() <= 30
    assert ins.min() <= 52 and ins.max() >= 148  # the range is actually covered
    assert all(len(p.ids) == p.prompt_len for p in prompts)
    lo, hi = FALLBACK_ID_RANGE
    assert all(lo <= i < hi for p in prompts for i in p.ids)


def test_random_fixed_lengths_at_ratio_zero() -> None:
    prompts = random_prompts(50, 64, 8, 0.0, rng(), None)
    assert {p.prompt_len for p in prompts} == {64}
    assert {p.output_len for p in prompts} == {8}
    assert all(p.text is None for p in prompts)  # no tokenizer: ids only


def test_random_with_tokenizer_avoids_specials_and_decodes(tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    assert tok.special_ids == {0, 1}
    prompts = random_prompts(20, 30, 4, 0.0, rng(), tok)
    for p in prompts:
        assert not set(p.ids) & tok.special_ids
        assert tok.encode(p.text) == list(p.ids)  # the text form is the same prompt


def test_same_seed_same_prompts() -> None:
    cfg = BenchConfig(num_prompts=10, random_input_len=16, random_range_ratio=0.5, seed=3)
    assert build_prompts(cfg, None) == build_prompts(cfg, None)
    other = BenchConfig(num_prompts=10, random_input_len=16, random_range_ratio=0.5, seed=4)
    assert build_prompts(cfg, None) != build_prompts(other, None)


@pytest.mark.parametrize("with_tok", [False, True])
def test_shared_prefix_groups_share_prefixes(with_tok: bool, tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir)) if with_tok else None
    prompts = shared_prefix_prompts(24, 4, 32, 8, 5, rng(), tok)
    assert len(prompts) == 24
    groups: dict[int, list] = {}
    for p in prompts:
        assert p.prompt_len == len(p.ids) == 40 and p.output_len == 5
        groups.setdefault(p.group, []).append(p)
    assert sorted(groups) == [0, 1, 2, 3] and all(len(g) == 6 for g in groups.values())
    prefixes = {}
    for g, members in groups.items():
        heads = {m.ids[:32] for m in members}
        assert len(heads) == 1  # one prefix per group
        assert len({m.ids[32:] for m in members}) == 6  # distinct questions
        prefixes[g] = heads.pop()
        if tok:
            prefix_text = tok.decode(list(prefixes[g]))
            assert all(m.text.startswith(prefix_text) for m in members)
    assert len(set(prefixes.values())) == 4  # groups differ
    assert [p.group for p in prompts] != sorted(p.group for p in prompts)  # interleaved


def _write_sharegpt(path: Path) -> Path:
    long = " ".join(["word"] * 2000)
    data = [
        {"conversations": [{"from": "human", "value": "what is the capital of france ?"},
                           {"from": "gpt", "value": "the capital of france is paris ."}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},  # dropped
        {"conversations": [{"from": "human", "value": "hi"},  # too short: dropped
                           {"from": "gpt", "value": "hello there friend , how are you ?"}]},
        {"conversations": [{"from": "human", "value": long},  # too long: dropped
                           {"from": "gpt", "value": "a b c d e"}]},
        {"conversations": [{"role": "user", "content": "name three prime numbers please now"},
                           {"role": "assistant", "content": "two , three and five ."}]},
    ]
    path.write_text(json.dumps(data))
    return path


class WordCounter:
    """Stands in for a tokenizer: one token per whitespace-separated word."""

    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())


def test_sharegpt_loads_and_filters(tmp_path: Path) -> None:
    path = _write_sharegpt(tmp_path / "sg.json")
    prompts = sharegpt_prompts(path, 2, 0, rng(), WordCounter())
    texts = {p.text for p in prompts}
    assert texts == {"what is the capital of france ?", "name three prime numbers please now"}
    lens = {p.text: (p.prompt_len, p.output_len) for p in prompts}
    assert lens["what is the capital of france ?"] == (7, 7)
    assert lens["name three prime numbers please now"] == (6, 6)


def test_sharegpt_fixed_output_len_and_oversampling(tmp_path: Path) -> None:
    path = _write_sharegpt(tmp_path / "sg.json")
    prompts = sharegpt_prompts(path, 7, 16, rng(), WordCounter())
    assert len(prompts) == 7  # only two usable conversations: resampled up to 7
    assert {p.output_len for p in prompts} == {16}
    assert len({p.text for p in prompts}) == 2


def test_sharegpt_without_tokenizer_estimates(tmp_path: Path) -> None:
    prompts = sharegpt_prompts(_write_sharegpt(tmp_path / "sg.json"), 2, 0, rng(), None)
    assert all(p.prompt_len >= 4 for p in prompts)


def test_sharegpt_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        sharegpt_prompts(bad, 1, 0, rng(), None)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no usable conversation"):
        sharegpt_prompts(empty, 1, 0, rng(), None)
