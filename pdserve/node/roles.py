"""Pick the engine role of a node process from its config (composition, not mode flags)."""

from __future__ import annotations

from pdserve.engine.role import Role


def make_role(cfg) -> Role:
    """`cfg` is a ServerConfig; colocated nodes get the plain Role."""
    if cfg.role == "prefill":
        from prefill_node.role import PrefillRole

        return PrefillRole(cfg.pd.transfer, cfg.engine.model, not cfg.pd.disable_early_send,
                           cfg.pd.early_start_kv_fraction)
    if cfg.role == "decode":
        from decode_node.role import DecodeRole

        return DecodeRole(cfg.pd.transfer, cfg.engine.model)
    return Role()
