"""Runs one packed batch on the device: resolve futures, forward, sample, store futures."""

from __future__ import annotations

import functools
import time
from collections import deque

import torch

from pdserve.engine import logprobs
from pdserve.engine.batch import Batch
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.future_map import FutureMap
from pdserve.engine.logit_processing import LogitProcessor
from pdserve.engine.logprobs import LogprobOutput
from pdserve.engine.sampler import Sampler, SamplingBatch
from pdserve.memory.kv_pool import KVPool
from pdserve.models.llama import AttnMeta, CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: KVPool, future_map: FutureMap,
                 sampler: Sampler, device: torch.device, hicache=None,
                 graphs: DecodeGraphs | None = None, num_slots: int = 1) -> None:
        self.hicache = hicache  # HiCacheController or None
        self.graphs = graphs  # CUDA graphs of decode batches, or None (eager forwards)
        # (batch seq, start, end) of recent forwards (perf_counter): lets tests check that a
        # HiCache load overlapped a forward (docs/architecture.md: HiCache).
        self.timeline: deque[tuple[int, float, float]] = deque(maxlen=1024)
        self.model = model
        self.kv_pool = kv_pool
        self.future_map = future_map
        self.sampler = sampler
        self.logits = LogitProcessor(num_slots, device)  # penalties, bias, min tokens
        self.device = device
        self._paged_decode = model.paged_decode()  # decode rows read the pool in place
        self._paged_extend = model.paged_extend()  # and so do prompt rows, where supported
        # Batch-invariant ops: every row, decode rows too, is a prompt row over the pool, so
        # a token's attention never depends on which kind of row computed it.
        self._one_group = getattr(getattr(model, "ops", None), "batch_invariant", False)

    def attention_paths(self) -> dict[str, str]:
        """Which attention serves each kind of row (docs/architecture.md: "Engine speed")."""
        if self._one_group:
            return {"decode": "batch-invariant (as one-token prompt rows)",
                    "prompt": "batch-invariant"}
        paths = {"decode": "paged kernel" if self._paged_decode else "sdpa (gathered pages)",
                 "prompt": "paged kernel" if self._paged_extend else "sdpa"}
        products = getattr(getattr(self.model, "ops", None), "extend_products", None)
        if self._paged_extend and products is not None:  # the CPU kernel: AMX or AVX512-BF16
            paths["prompt_products"] = products(
                self.model.model.decoder_layers[0].self_attn.head_dim)
        return paths

    def graphs_info(self) -> dict:
        if self.graphs is None:
            return {"enabled": False,
                    "reason": "eager forwards (CPU, TP, a prefill node, or turned off)"}
        return self.graphs.describe()

    def run(self, batch: Batch) -> tuple[torch.Tensor, LogprobOutput | None]:
        """Forward + sample; returns sampled token ids [R] on the device, and the batch's
        logprobs when a row asked (docs/architecture.md: Logprobs)."""
        t0 = time.perf_counter()
        try:
            return self._run(batch)
        finally:
            self.timeline.append((batch.seq, t0, time.perf_counter()))

    @torch.inference_mode()
    def _run(self, batch: Batch) -> tuple[torch.Tensor, LogprobOutput | None]:
        assert batch.packed is not None  # packed by the scheduler thread before launch
        t = batch.packed.to_device(self.device)
        key = self.graphs.key_for(batch) if self.graphs is not None else None
        meta = None if key is not None else self._attn_meta(batch, t)
        input_ids = self.future_map.resolve(t["input_ids"])
        rows, spec = t["logit_rows"], batch.lp
        n_sample = rows.numel()
        if spec is not None and t["plp_rows"].numel():
            rows = torch.cat([rows, t["plp_rows"]])  # prompt logprob rows after the samples
        if rows.numel() == 0:  # a middle chunk only: nothing to sample
            self.model(input_ids, t["positions"], meta, self.kv_pool, rows)
            return t["logit_rows"], None
        if key is not None:  # a pure decode batch: every row samples, rows == [0, n)
            assert self.graphs is not None
            logits = self.graphs.run(key, t, input_ids)
        else:
            logits = self.model(input_ids, t["positions"], meta, self.kv_pool, rows)
        sample_logits = logits[:n_sample]
        tokens = t["logit_rows"]
        if n_sample:
            x = self.logits.apply(sample_logits, t) if batch.processes_logits else sample_logits
            if batch.grammar is not None:
                if not batch.processes_logits and spec is not None:
                    x = x.clone()  # logprobs report the raw logits
                batch.grammar.apply(x)  # waits for the scheduler to fill the mask
            tokens = self.sampler(x, SamplingBatch(
                t["temperature"], t["top_p"], t["top_k"], list(batch.generators),
                batch.all_greedy, t["lx_min_p"] if batch.uses_min_p else None))
            if batch.processes_logits:
                self.logits.record(t, tokens)
            self.future_map.store(t["future_ids"], tokens)
        if spec is None:
            return tokens, None
        return tokens, logprobs.compute(spec, sample_logits, tokens, logits[n_sample:],
                                        t["plp_targets"])

    def _attn_meta(self, batch: Batch, t: dict[str, torch.Tensor]) -> AttnMeta:
        """Split the rows into the prompt group (first) and the decode group (last rows,
        read in place by the paged kernel when the model has one, else SDPA over their own
        gathered pages), and build each group's indices. Host-side lengths come from
        `batch.rows`."""
        n_dec = 0 if self._one_group else batch.num_decode_rows
        prompt = batch.rows[:len(batch.rows) - n_dec]
        ps = self.kv_pool.page_size
        decode_pages = t["kv_pages"][len(prompt):] if n_dec else None
        if n_dec and not self._paged_decode:  # gathered: only the decode rows' own pages
            assert decode_pages is not None
            longest = max(r.start + 1 for r in batch.rows[len(prompt):])
            decode_pages = decode_pages[:, :-(-longest // ps)]
        # Fresh rows (all from position 0) attend over their own k/v unless a paged extend
        # kernel serves every prompt row; rows with cached context always read the pool.
        fresh = bool(prompt) and not self._paged_extend and all(r.start == 0 for r in prompt)
        pooled = bool(prompt) and not fresh
        return AttnMeta(
            out_cache_loc=t["out_cache_loc"], kv_pages=t["kv_pages"][:len(prompt)],
            batch=len(prompt), page_size=ps,
            # decode rows come last, one token each at position (context length - 1)
            seq_lens=t["positions"][-n_dec:] + 1 if n_dec else None,
            decode_pages=decode_pages,
            fresh_lens=tuple(r.q_len for r in prompt) if fresh else None,
            extend_starts=tuple(r.start for r in prompt) if pooled else None,
            extend_lens=tuple(r.q_len for r in prompt) if pooled else None,
            layer_wait=functools.partial(self._wait_layer, op_id=batch.load_barrier)
            if batch.load_barrier else None,
        )

    def _wait_layer(self, layer: int, op_id: int) -> None:
        self.hicache.wait_layer(layer, op_id)
