"""Flags that keep the memory of the model nodes the test harnesses start small (any folder
imports it, like hf_reference)."""

from __future__ import annotations

KV_MB = 64  # 65k tokens of tiny-llama


def small_kv(model: str) -> list[str]:
    """A tiny model's node gets a 64 MiB KV pool instead of the CPU default of 512 MiB,
    which is touched at start: the suite keeps many nodes alive at once (the session stacks
    live until the run ends), and with the default pools two pytest-xdist workers run a
    24 GiB machine out of memory. Flags given after these still win (argparse keeps the
    last). Other models keep their default."""
    return ["--kv-cache-mb", str(KV_MB)] if model.startswith("tiny-") else []
