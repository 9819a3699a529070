"""The whole two-tier service on one machine: `pdserve up` (registry, prefill nodes,
decode nodes and the router as child processes) and `pdserve demo` (`up`, a short load
test through the router, a TTFT/TPOT summary, a clean shutdown)."""
