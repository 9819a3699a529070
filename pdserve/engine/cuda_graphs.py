"""CUDA graphs of decode batches (docs/architecture.md: "CUDA graphs").

On a GPU a small model's decode step is bound by kernel launches, not by the GPU: every
layer launches a dozen kernels from Python, each costing more host time than the GPU
spends running it. A CUDA graph records one forward's kernels once; a replay launches all
of them at once. A graph's inputs must stay at the addresses and shapes it was recorded
with, so:

- a batch's rows are padded up to a row bucket (1, 2, 4, 8, then steps of 8 up to
  `max_rows`): padded rows repeat the last real row (its token, position, KV slot and
  pages), so they write the very same K/V to the very same slot and need no scratch page;
- its context is padded up to a page bucket (powers of two): each row reads (or, gathered,
  unmasks) only its own length, and the page ids past it are stale but valid (a gather
  stays in the pool);
- inputs are copied into static buffers (the largest shapes; a graph uses leading slices)
  and the logits come out of the graph's own output tensor, read before the next replay.

Every (rows, pages) graph is captured when the engine starts, before any request exists:
the warm-up forwards write K/V into one page borrowed from the allocator and given back.
They share one memory pool (captured largest first). One replay is then checked against the
eager forward on the same inputs; any capture error or mismatch turns graphs off with the
reason in /server_info, so a GPU the graphs do not suit still serves, eagerly.

Only pure decode batches replay (no prompt rows, no HiCache load to wait for); sampling
and logprobs stay outside the graph. CPU and tensor-parallel nodes never use graphs.
`capture=False` runs the same padded static path eagerly: what the CPU tests check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.batch import Batch
from pdserve.memory.kv_pool import KVPool
from pdserve.models.llama import AttnMeta

log = logging.getLogger(__name__)


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_rows (always included)."""
    out = [b for b in (1, 2, 4, 8) if b < max_rows]
    out += list(range(16, max_rows, 8))
    return sorted(set(out + [max_rows]))


def page_buckets(max_pages: int) -> list[int]:
    """Powers of two from 4 pages, up to max_pages (always included)."""
    out, b = [], 4
    while b < max_pages:
        out.append(b)
        b *= 2
    return out + [max_pages]


def bucket(n: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass
class GraphState:
    enabled: bool
    reason: str
    # key -> its graph; None for every key when capture=False (eager static forwards)
    graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = field(default_factory=dict)
    replays: int = 0


class DecodeGraphs:
    """Static decode inputs, one graph (or, with capture=False, one eager call) per bucket."""

    def __init__(self, model: Callable, kv_pool: KVPool, device: torch.device, max_rows: int,
                 max_pages: int, capture: bool = True) -> None:
        self.model, self.kv_pool, self.device = model, kv_pool, device
        self.capture = capture
        self.rows = row_buckets(max_rows)
        self.pages = page_buckets(max_pages)
        r, p = self.rows[-1], self.pages[-1]
        i64 = torch.int64
        self.input_ids = torch.zeros(r, dtype=i64, device=device)
        self.positions = torch.zeros(r, dtype=i64, device=device)
        self.out_cache_loc = torch.zeros(r, dtype=i64, device=device)
        self.kv_pages = torch.zeros(r, p, dtype=i64, device=device)
        self.logit_rows = torch.arange(r, dtype=i64, device=device)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.state = GraphState(False, "not captured")
        self._pool: torch.cuda._POOL_HANDLE | None = None  # the graphs' shared memory pool

    # -- start-up -------------------------------------------------------------------------
    def capture_all(self) -> GraphState:
        """Record every bucket's graph with one borrowed page; turn graphs off on failure."""
        page = self.kv_pool.allocator.alloc(1)
        if page is None:
            self.state = GraphState(False, "no free KV page to capture with")
            return self.state
        try:
            self._fill_dummy(page[0])
            keys = sorted(((r, p) for r in self.rows for p in self.pages), reverse=True)
            graphs = {k: self._record(*k) for k in keys}
            self.state = GraphState(True, f"{len(graphs)} decode graphs "
                                          f"(rows {self.rows}, pages {self.pages})", graphs)
            self._self_check()
        except Exception as exc:  # a GPU or op the graphs do not suit: serve eagerly
            log.warning("CUDA graphs off: %s: %s", type(exc).__name__, exc)
            self.state = GraphState(False, f"capture failed: {type(exc).__name__}: {exc}")
            self.outputs.clear()
        finally:
            self.kv_pool.allocator.free(page)
        return self.state

    def _fill_dummy(self, page: int) -> None:
        ps = self.kv_pool.page_size
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.fill_(page * ps)
        self.kv_pages.fill_(page)

    def _record(self, rows: int, pages: int) -> torch.cuda.CUDAGraph | None:
        if not self.capture:
            return None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: cuBLAS workspaces, allocator, lazy inits
                self._forward(rows, pages)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self.outputs[(rows, pages)] = self._forward(rows, pages)
        self._pool = graph.pool()
        return graph

    def _self_check(self) -> None:
        """The smallest graph's replay equals the eager forward on the same (dummy) inputs."""
        if not self.capture:
            return
        key = (self.rows[0], self.pages[0])
        self._replay(key)
        replayed = self.outputs[key].clone()
        eager = self._forward(*key)
        if not torch.allclose(replayed, eager, rtol=1e-3, atol=1e-3):
            diff = (replayed - eager).abs().max().item()
            raise RuntimeError(f"replayed logits differ from the eager forward by {diff:.3g}")

    # -- serving --------------------------------------------------------------------------
    def key_for(self, batch: Batch) -> tuple[int, int] | None:
        """The bucket a batch replays in, or None (eager): pure decode rows that all
        sample, no HiCache load, within the largest buckets."""
        if not self.state.enabled or batch.kind != "decode" or batch.load_barrier:
            return None
        rows = batch.rows
        if not all(r.decode and r.future_id for r in rows):
            return None
        ps = self.kv_pool.page_size
        need = -(-max(r.start + r.q_len for r in rows) // ps)
        r, p = bucket(len(rows), self.rows), bucket(need, self.pages)
        return None if r is None or p is None else (r, p)

    def run(self, key: tuple[int, int], t: dict[str, torch.Tensor],
            input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of the batch's n rows (a view of the graph's output: read it before
        the next replay). `t`: the batch's device tensors; `input_ids` resolved."""
        rows, pages = key
        n = input_ids.shape[0]
        _pad_copy(self.input_ids, input_ids, rows)
        _pad_copy(self.positions, t["positions"], rows)
        _pad_copy(self.out_cache_loc, t["out_cache_loc"], rows)
        kv = t["kv_pages"]  # [n, P], P <= pages; columns past P keep stale valid page ids
        _pad_copy(self.kv_pages[:, :kv.shape[1]], kv, rows)
        self.state.replays += 1
        if self.capture:
            self._replay(key)
            return self.outputs[key][:n]
        return self._forward(rows, pages)[:n]

    def _replay(self, key: tuple[int, int]) -> None:
        graph = self.state.graphs[key]
        assert graph is not None, "replay of an uncaptured bucket"  # only when self.capture
        graph.replay()

    def _forward(self, rows: int, pages: int) -> torch.Tensor:
        """The recorded forward: static slices in, logits [rows, V] out."""
        ps = self.kv_pool.page_size
        pos = self.positions[:rows]
        # Every row is a decode row: the paged kernel reads each row's context up to its
        # length (pos + 1); without one, SDPA over the bucket's pages, masked past it.
        pages_t = self.kv_pages[:rows, :pages]
        meta = AttnMeta(out_cache_loc=self.out_cache_loc[:rows], kv_pages=pages_t[:0],
                        batch=0, page_size=ps,
                        seq_lens=pos + 1, decode_pages=pages_t)
        return self.model(self.input_ids[:rows], pos, meta, self.kv_pool,
                          self.logit_rows[:rows])

    def describe(self) -> dict:
        return {"enabled": self.state.enabled, "reason": self.state.reason,
                "replays": self.state.replays}


def _pad_copy(dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
    """dst[:n] = src; dst[n:rows] = src[n - 1] (padded rows repeat the last real one)."""
    n = src.shape[0]
    dst[:n].copy_(src)
    if rows > n:
        dst[n:rows].copy_(src[n - 1:n].expand(rows - n, *src.shape[1:]))
