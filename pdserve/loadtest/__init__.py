"""Load-test harness behind `pdserve bench` (docs/architecture.md: Load-test harness).

A light client process: asyncio + httpx streaming, numpy statistics, matplotlib plots.
Nothing here imports torch; a tokenizer is loaded only when a run needs one.

Layout: `config` (the frozen run config), `dataset` (prompts), `arrivals` (request times),
`backends` (payloads and stream parsing per API), `client` (one timed request),
`runner` (one run), `metrics` (per-request and aggregate numbers), `report` (table and
JSONL), `plots` (PNG), `compare` (`pdserve bench compare`), `cli` (argparse).
"""
