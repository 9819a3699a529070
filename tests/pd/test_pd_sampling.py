"""Penalties, logit_bias and min_new_tokens across the PD split: the prefill node samples the
first token under them (its prompt counts for the repetition penalty), the decode node
rebuilds the counts from that token and goes on; the tokens equal the colocated engine's
(docs/architecture.md: Sampling)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pd_pair import PDCluster, colocated, greedy, random_prompt

PROMPTS = [random_prompt(n, seed=40 + n) for n in (5, 30, 70)]
B = {"17": 6.0, "42": 5.5}
CASES = {
    "frequency": dict(logit_bias=B, frequency_penalty=1.5),
    "presence+repetition": dict(logit_bias=B, presence_penalty=2.0, repetition_penalty=1.3),
    # The first token is the prompt's own first token unless the penalty sees the prompt.
    "repetition-of-prompt": dict(logit_bias={str(PROMPTS[1][0]): 6.0},
                                 repetition_penalty=3.0),
    "min-tokens": dict(logit_bias={"2": 100.0}, min_new_tokens=3),
}


@pytest.fixture(scope="module")
def cluster():
    c = PDCluster("tiny-llama", "mooncake", prefills=[{"chunked_prefill_size": 32}])
    yield c
    c.close()


@pytest.mark.parametrize("case", list(CASES))
def test_pd_penalties_equal_colocated(cluster, case):
    kw = CASES[case]
    params = greedy(12, **kw)
    params.ignore_eos = case != "min-tokens"
    legs = cluster.generate(PROMPTS, params)
    want = [o.output_ids for o in colocated("tiny-llama").generate(PROMPTS, params)]
    assert [leg.output_ids for leg in legs] == want
    plain = greedy(12, **{k: v for k, v in kw.items() if k == "logit_bias"})
    plain.ignore_eos = params.ignore_eos
    control = [o.output_ids for o in colocated("tiny-llama").generate(PROMPTS, plain)]
    assert want != control, "the case changes nothing: it could not fail"
    cluster.assert_pools_full()


SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4},
    "ok": {"type": "boolean"}}, "required": ["id", "tags", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("kw", [dict(json_schema=json.dumps(SCHEMA)),
                                dict(regex=r"[a-c]{2}[0-9]{3}", frequency_penalty=1.0)],
                         ids=["json_schema", "regex+penalty"])
def test_pd_structured_output_equals_colocated(cluster, kw):
    """The prefill node samples the first token under the grammar; the decode node's matcher
    accepts that token before it masks the next one."""
    params = greedy(60, **kw)
    params.ignore_eos = False
    legs = cluster.generate(PROMPTS, params)
    want = colocated("tiny-llama").generate(PROMPTS, params)
    assert [leg.output_ids for leg in legs] == [o.output_ids for o in want]
    for o in want:
        if "json_schema" in kw:
            jsonschema.validate(json.loads(o.text, strict=False), SCHEMA)
        else:
            assert re.fullmatch(r"[a-c]{2}[0-9]{3}", o.text), o.text
    cluster.assert_pools_full()
