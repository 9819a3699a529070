"""The ranks of one TP node: their process group, and how rank 0 hands a forward to the
others (docs/architecture.md: Tensor parallelism).

The group is a torch.distributed backend object built directly on a TCPStore (gloo on CPU,
NCCL on CUDA), not the global default group: several engines may live in one process
(tests) and each closes its own group.

Control vs data: rank 0 writes a small msgpack *header* (op, tensor specs, scalars) to each
worker's stdin pipe; the tensors themselves follow as ONE uint8 `broadcast` (each tensor's
bytes at an 8-byte aligned offset). The pipe is also the liveness signal: a worker reads EOF
when rank 0 goes away, and rank 0 gets a broken pipe when a worker does. No pickle anywhere
(torch's object collectives pickle).
"""

from __future__ import annotations

import dataclasses
import datetime
import struct
from typing import IO, Any

import msgpack
import torch
import torch.distributed as dist

# A collective waits this long for its peers (a stuck rank fails the forward, not a hang).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.int64, torch.int32, torch.bool, torch.float32, torch.float16, torch.bfloat16,
    torch.uint8)}


class TPGroup:
    """Rank `rank` of `size`; the collectives a sharded model and the batch hand-off use."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: torch.device
                 ) -> None:
        self.rank, self.size, self.device = rank, size, device
        store = dist.TCPStore(host, port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        self.store: dist.TCPStore | None = store
        self.port = store.port
        self.pg: Any = None  # a gloo or NCCL process group, once connected

    def connect(self) -> None:
        """Blocks until every rank has joined."""
        assert self.store is not None, "connect() after close()"
        store = dist.PrefixStore("tp", self.store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = COLLECTIVE_TIMEOUT
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = COLLECTIVE_TIMEOUT
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.size, opts)

    def all_reduce(self, t: torch.Tensor) -> None:
        self.pg.allreduce([t]).wait()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t]).wait()
        return out

    def broadcast(self, t: torch.Tensor) -> None:
        self.pg.broadcast(t, 0).wait()

    def close(self) -> None:
        self.pg = None
        self.store = None


# -- control messages on a pipe: 4-byte big-endian length, then msgpack ------------------
def write_msg(pipe: IO[bytes], msg: dict) -> None:
    body = msgpack.packb(msg)
    pipe.write(struct.pack(">I", len(body)) + body)
    pipe.flush()


def read_msg(pipe: IO[bytes]) -> dict | None:
    """The next message, or None at EOF (rank 0 is gone)."""
    head = pipe.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    body = pipe.read(n)
    return msgpack.unpackb(body) if len(body) == n else None


# -- a forward's tensors as one byte buffer ------------------------------------------------
def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[list, torch.Tensor]:
    """-> (specs [[name, dtype, shape, offset, nbytes]], uint8 payload on the tensors'
    device). Offsets are 8-byte aligned so a slice can be viewed back without a copy."""
    specs, chunks, off = [], [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8)
        pad = -raw.numel() % 8
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), off,
                      raw.numel()])
        chunks.append(raw)
        if pad:
            chunks.append(raw.new_zeros(pad))
        off += raw.numel() + pad
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return specs, payload


def unpack_tensors(specs: list, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype, shape, off, n in specs:
        out[name] = payload[off:off + n].view(_DTYPES[dtype]).view(shape)
    return out


def split_meta(meta) -> tuple[dict[str, torch.Tensor], dict]:
    """An AttnMeta -> (its tensor fields, its plain fields). Generic over the dataclass so
    a field added to AttnMeta travels without touching this file; a callable must be None
    under TP (the HiCache layer wait is refused with --tp-size > 1)."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        if isinstance(v, torch.Tensor):
            tensors[f.name] = v
        elif v is None or isinstance(v, bool | int | float | str):
            plain[f.name] = v
        elif isinstance(v, tuple) and all(isinstance(x, int) for x in v):
            plain[f.name] = list(v)  # msgpack has no tuple; the worker rebuilds it
        else:
            raise TypeError(f"AttnMeta.{f.name} ({type(v).__name__}) cannot go to TP ranks")
    return tensors, plain
