"""A worker rank (1..N-1) of a TP node: `python -m pdserve.engine.tp_worker` (started by rank
0, pdserve/engine/tp_driver.py; docs/architecture.md: Tensor parallelism).

It loads the model, keeps its shard, owns a KV pool for its KV heads (same page count and
page table as rank 0: rank 0 sends the slots with each batch), then runs every forward rank
0 announces on stdin. On a prefill / decode node it also runs this rank's KV transfers
(pdserve/pd/tp_rooms.py), replying on stdout. It exits on "stop", at EOF of stdin (rank
0 is gone), when its parent process changes (rank 0 killed while this rank sat in a
collective), or when a collective fails (another rank died).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from pdserve.config import EngineConfig
from pdserve.engine.tp_driver import rank_device
from pdserve.engine.tp_group import TPGroup, read_msg, unpack_tensors
from pdserve.memory.kv_pool import KVLayout, KVPool
from pdserve.models.attention_backends import choose_attention
from pdserve.models.llama import AttnMeta
from pdserve.models.loader import load_model
from pdserve.models.ops import choose_ops
from pdserve.models.parallel import plan_tp, shard_model

if TYPE_CHECKING:  # imported when a "transfer" op arrives: a PD node only
    from pdserve.pd.tp_rooms import WorkerTransfer

log = logging.getLogger("pdserve.tp_worker")


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)  # rank 0 died; nothing of ours needs an orderly shutdown


def serve(cfg: EngineConfig, rank: int, port: int, replies) -> None:
    device = rank_device(cfg.torch_device(), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.threads:  # every rank runs the forward with the node's thread count
        torch.set_num_threads(cfg.threads)
    loaded = load_model(cfg.model, cfg.dtype, device, cfg.model_cache_dir, cfg.revision,
                        cfg.load_format)
    base = choose_ops(cfg.kernels, device).ops  # the same ops as rank 0
    loaded.model.ops = choose_attention(cfg.attention_backend, base, device).ops
    plan = plan_tp(loaded.hf_config, cfg.tp_size, rank)
    group = TPGroup("127.0.0.1", port, rank, cfg.tp_size, device)
    group.connect()
    shard_model(loaded.model, plan, group)
    stdin = sys.stdin.buffer
    init = read_msg(stdin)
    if init is None:
        return
    hf = loaded.hf_config
    layout = KVLayout(hf.num_hidden_layers, plan.local_kv_heads, plan.head_dim, loaded.dtype,
                      cfg.page_size)
    pool = KVPool(layout, int(init["num_pages"]), device)
    transfer: WorkerTransfer | None = None
    try:
        while (msg := read_msg(stdin)) is not None and msg["op"] != "stop":
            if msg["op"] == "forward":
                _forward(msg, group, loaded.model, pool, device)
            elif msg["op"] == "transfer":  # a prefill / decode node: this rank's transfers
                from pdserve.pd.tp_rooms import WorkerTransfer

                transfer = WorkerTransfer(pool, rank, msg, replies, threading.Lock())
            else:
                assert transfer is not None, f"{msg['op']!r} before the 'transfer' op"
                transfer.handle(msg)
    finally:
        if transfer is not None:
            transfer.close()


def _forward(msg: dict, group: TPGroup, model, pool: KVPool, device: torch.device) -> None:
    payload = torch.empty(int(msg["nbytes"]), dtype=torch.uint8, device=device)
    group.broadcast(payload)
    t = unpack_tensors(msg["specs"], payload)
    ids, pos, rows = t.pop("input_ids"), t.pop("positions"), t.pop("logit_rows")
    # AttnMeta's fields as rank 0 built them (model_runner._attn_meta): tensors from the
    # payload, the rest (ints; tuples, sent as lists) from the JSON message: typed there.
    tensors: dict[str, Any] = t
    plain: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                             for k, v in msg["plain"].items()}
    meta = AttnMeta(**tensors, **plain)
    model(ids, pos, meta, pool, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {args.rank}] %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # stdout is the reply pipe to rank 0; anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        serve(EngineConfig(**json.loads(args.config)), args.rank, args.port, replies)
    except Exception as exc:  # a peer died mid-collective, or the model would not load
        log.error("TP worker rank %d stops: %s", args.rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
