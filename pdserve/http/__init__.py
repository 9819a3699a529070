"""The HTTP layer shared by every pdserve server and client: the node (`pdserve.node`),
the router (`pdserve.router`), the PD glue (`pdserve.pd`) and the registry import it,
and it imports none of them (docs/architecture.md: Module map).

Request bodies (`protocol.py`, `sglang_body.py`, `plain_json.py`), errors and their
handlers (`errors.py`), OpenAI answers and logprob shapes (`openai_format.py`,
`openai_plan.py`, `logprob_format.py`, `choices.py`), incremental detokenization
(`detokenizer.py`), SSE writing and reading (`sse.py`), the shared tokenize routes, the
body-size limit and the h11 guard (`body_limit.py`, `guard.py`), latency buckets
(`latency.py`)."""
