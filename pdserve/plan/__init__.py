"""Capacity planning: `pdserve profile` measures one node, `sim*.py` simulate a cluster of
such nodes, `pdserve plan` searches the P:D split that meets the SLOs at the least cost
(docs/architecture.md: Capacity planning)."""
