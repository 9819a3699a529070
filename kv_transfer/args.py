"""What a node registers with the transfer layer: raw KV and metadata buffers.

The engine's KV pool holds, per layer, one contiguous K and one contiguous V buffer of
shape [num_pages * page_size, num_kv_heads, head_dim]; so page p of layer l occupies bytes
[p * page_bytes, (p + 1) * page_bytes) of that layer's K (and V) buffer. This module only
deals in pointers and byte counts, never in tensors, so it does not need torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1,
}


def normalize_dtype(dtype: Any) -> str:
    """'torch.bfloat16' / torch.bfloat16 / 'bfloat16' -> 'bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {dtype!r}")
    return name


@dataclass(frozen=True)
class PeerLayout:
    """Everything two nodes must agree on before one may write into the other's pages."""

    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model: str
    tp_rank: int = 0  # which rank of a TP node this pool is (its KV heads: kv_transfer/heads.py)
    tp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"layout {name} must be > 0")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError("layout tp_rank must be in [0, tp_size)")

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def head_bytes(self) -> int:
        return self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def tp_name(self) -> str:
        return f"TP rank {self.tp_rank} of {self.tp_size} ({self.num_kv_heads} KV heads)"

    def mismatch(self, other: PeerLayout, heads: bool = True) -> str | None:
        """A human-readable reason why KV from `self` cannot go into `other`, or None.
        `heads` False: the KV head count and TP rank may differ (a node of another TP
        size; each room then checks the peer rank it expects: `tp_mismatch`)."""
        names = ("model", "page_size", "dtype", "num_layers", "head_dim")
        for name in names + (("num_kv_heads",) if heads else ()):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"incompatible KV layout: {name} {mine!r} != {theirs!r}"
        return None

    def tp_mismatch(self, rank: int, size: int, heads: int) -> str | None:
        """Why this pool is not TP rank `rank` of `size` holding `heads` KV heads, or None."""
        if (self.tp_rank, self.tp_size, self.num_kv_heads) == (rank, size, heads):
            return None
        if (self.tp_rank, self.tp_size) == (rank, size):
            return f"incompatible KV layout: num_kv_heads {heads!r} != {self.num_kv_heads!r}"
        return (f"incompatible KV layout: the peer is {self.tp_name}, this transfer writes "
                f"TP rank {rank} of {size} ({heads} KV heads)")


@dataclass(frozen=True)
class KVArgs:
    """Registered buffers of one node.

    k_ptrs / v_ptrs: data_ptr() of each layer's K / V buffer; buf_lens: their byte length
    (K and V of a layer have the same length). Metadata buffers hold `meta_rows` rows each;
    buffer b has rows of meta_row_bytes[b] bytes (first token id, logprobs, ...); a request
    owns one row index (its metadata slot) in every metadata buffer.
    """

    layout: PeerLayout
    k_ptrs: tuple[int, ...]
    v_ptrs: tuple[int, ...]
    buf_lens: tuple[int, ...]
    page_bytes: int
    num_pages: int
    meta_ptrs: tuple[int, ...] = ()
    meta_row_bytes: tuple[int, ...] = ()
    meta_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("k_ptrs", "v_ptrs", "buf_lens", "meta_ptrs", "meta_row_bytes"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        layers = self.layout.num_layers
        if not len(self.k_ptrs) == len(self.v_ptrs) == len(self.buf_lens) == layers:
            raise ValueError(f"need {layers} K pointers, V pointers and lengths")
        if self.page_bytes != self.layout.page_bytes:
            raise ValueError(f"page_bytes {self.page_bytes} != layout's {self.layout.page_bytes}")
        if self.num_pages <= 0:
            raise ValueError("num_pages must be > 0")
        if any(n < self.num_pages * self.page_bytes for n in self.buf_lens):
            raise ValueError("a layer buffer is shorter than num_pages * page_bytes")
        if len(self.meta_ptrs) != len(self.meta_row_bytes):
            raise ValueError("need one row size per metadata buffer")
        if self.meta_ptrs and self.meta_rows <= 0:
            raise ValueError("metadata buffers need meta_rows > 0")
        if any(p <= 0 for p in self.k_ptrs + self.v_ptrs + self.meta_ptrs):
            raise ValueError("buffer pointers must be non-null")

    def regions(self) -> list[tuple[int, int]]:
        """(pointer, length) of every buffer, as registered with the transfer engine."""
        kv = [(p, n) for p, n in zip(self.k_ptrs, self.buf_lens, strict=True)]
        kv += [(p, n) for p, n in zip(self.v_ptrs, self.buf_lens, strict=True)]
        meta = [(p, self.meta_rows * r) for p, r in zip(self.meta_ptrs, self.meta_row_bytes,
                                                        strict=True)]
        return kv + meta

    def layer_buffers(self) -> list[int]:
        """K buffers of all layers, then V buffers: the canonical buffer order."""
        return list(self.k_ptrs) + list(self.v_ptrs)

    def meta_row(self, buffer: int, slot: int) -> tuple[int, int]:
        """(pointer, length) of metadata row `slot` in metadata buffer `buffer`."""
        size = self.meta_row_bytes[buffer]
        return self.meta_ptrs[buffer] + slot * size, size

    @classmethod
    def from_tensors(cls, k_bufs: Sequence[Any], v_bufs: Sequence[Any], page_size: int,
                     model: str, meta_bufs: Sequence[Any] = (),
                     tp: tuple[int, int] = (0, 1)) -> KVArgs:
        """Build from the engine's tensors (duck-typed: data_ptr/shape/...; no torch import).

        k_bufs[l], v_bufs[l]: contiguous [num_pages * page_size, num_kv_heads, head_dim].
        meta_bufs[b]: contiguous with first dimension = rows. tp: (rank, size) of this pool.
        """
        k0 = k_bufs[0]
        tokens, heads, head_dim = (int(x) for x in k0.shape)
        layout = PeerLayout(page_size, len(k_bufs), heads, head_dim, normalize_dtype(k0.dtype),
                          model, tp[0], tp[1])
        lens = [int(t.numel() * t.element_size()) for t in k_bufs]
        if [int(t.numel() * t.element_size()) for t in v_bufs] != lens:
            raise ValueError("K and V buffers of a layer must have the same size")
        if not all(t.is_contiguous() for t in [*k_bufs, *v_bufs, *meta_bufs]):
            raise ValueError("KV and metadata buffers must be contiguous")
        rows = int(meta_bufs[0].shape[0]) if meta_bufs else 0
        return cls(
            layout=layout, k_ptrs=tuple(t.data_ptr() for t in k_bufs),
            v_ptrs=tuple(t.data_ptr() for t in v_bufs), buf_lens=tuple(lens),
            page_bytes=layout.page_bytes, num_pages=tokens // page_size,
            meta_ptrs=tuple(t.data_ptr() for t in meta_bufs),
            meta_row_bytes=tuple(int(t[0].numel() * t.element_size()) for t in meta_bufs),
            meta_rows=rows,
        )
