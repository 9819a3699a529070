"""The engine: wires model, KV memory, scheduler, executor and loop; one `step()` API.

Used directly by the offline `LLM` and, in a scheduler process, by the node servers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pdserve.cache.hicache_controller import HiCacheController
from pdserve.cache.kv_storage import PageStore, make_storage
from pdserve.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.executor import InlineExecutor, ThreadedExecutor
from pdserve.engine.future_map import FutureMap
from pdserve.engine.grammar import GrammarCompiler, RequestGrammar
from pdserve.engine.kv_manager import KVManager
from pdserve.engine.kv_sizing import kv_pool_size, probe_activation_peak
from pdserve.engine.loop_choice import choose_loop
from pdserve.engine.loops import NormalLoop, OverlapLoop
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Req
from pdserve.engine.role import Role, RoleContext
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.staging import StagingRing
from pdserve.engine.tp_driver import send_init, start_tp
from pdserve.memory.host_pool import HostKVPool, host_pages_for, host_pool_bytes
from pdserve.memory.kv_pool import KVLayout, KVPool
from pdserve.memory.req_to_token import ReqToTokenPool
from pdserve.models import batch_invariant
from pdserve.models.attention_backends import choose_attention
from pdserve.models.loader import LoadedModel, load_model
from pdserve.models.ops import choose_ops
from pdserve.models.tokenizer import load_tokenizer
from pdserve.prompt_check import check_prompt_ids
from pdserve.sampling_params import SamplingParams, grammar_of
from pdserve.tracing.marks import Timeline

if TYPE_CHECKING:  # the engine hands a PD leg to its role without reading it
    from pdserve.pd.leg import PDLegFields

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, cfg: EngineConfig, role: Role | None = None) -> None:
        self.cfg = cfg
        self.role = role or Role()
        if cfg.threads:  # before anything runs a parallel op (and before the loop choice)
            torch.set_num_threads(cfg.threads)
        self.device = cfg.torch_device()
        self.loaded: LoadedModel = load_model(cfg.model, cfg.dtype, self.device,
                                              cfg.model_cache_dir, cfg.revision,
                                              cfg.load_format)
        self.ops_choice = choose_ops(cfg.kernels, self.device)
        self.attn_choice = choose_attention(cfg.attention_backend, self.ops_choice.ops,
                                            self.device)
        ops = self.attn_choice.ops
        if cfg.enable_deterministic_inference:
            ops = batch_invariant.wrap(ops, self.attn_choice.backend)
        self.loaded.model.ops = ops
        log.info("decoder ops: %s (%s); attention: %s (%s)", self.ops_choice.kind,
                 self.ops_choice.reason, self.attn_choice.backend, self.attn_choice.reason)
        self.tokenizer = load_tokenizer(self.loaded.path)
        hf = self.loaded.hf_config
        self.context_length = min(cfg.context_length or self.loaded.context_length,
                                  self.loaded.context_length)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # The model the runner calls: this process's CausalLM, or on a TP node rank 0's
        # TPModel, which runs the same forward on every rank.
        model: Any = self.loaded.model
        kv_heads, self.tp = hf.num_key_value_heads, None
        if cfg.tp_size > 1:  # this process is rank 0; this rank's pool holds its KV heads
            self.tp_plan, self.tp = start_tp(cfg, self.loaded)
            model, kv_heads = self.tp, self.tp_plan.local_kv_heads
        self.layout = KVLayout(hf.num_hidden_layers, kv_heads, head_dim,
                               self.loaded.dtype, cfg.page_size)
        self.pool_size = kv_pool_size(cfg, self.layout, self.device, self._probe_activations)
        log.info("KV pool: %d pages (%s)", self.pool_size.pages, self.pool_size.reason)
        self.kv_pool = KVPool(self.layout, self.pool_size.pages, self.device)
        if self.tp is not None:
            send_init(self.tp, self.kv_pool.num_pages)
        req_pool = ReqToTokenPool(cfg.max_running_requests + 1, self.context_length + 1)
        self.host_pool, self.hicache = self._make_hicache()
        self.page_store = self._make_page_store()
        self.kv = KVManager(self.kv_pool, req_pool, use_cache=not cfg.disable_prefix_cache,
                            host_pool=self.host_pool, ctrl=self.hicache,
                            write_policy=cfg.hicache_write_policy, store=self.page_store,
                            prefetch_timeout_s=cfg.hicache_storage_prefetch_timeout_s)
        self.future_map = FutureMap(cfg.max_running_requests, self.device)
        self.staging = StagingRing(self.device)
        self.sched = Scheduler(cfg, self.kv, self.future_map, self.staging, self.role,
                               self.loaded.hf_config.vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer, self.loaded.hf_config.vocab_size,
                                        self.loaded.eos_token_ids)
        self.compiling: list[Req] = []  # requests whose grammar is still compiling
        self.runner = runner = ModelRunner(model, self.kv_pool, self.future_map,
                                           Sampler(self.device, cfg.seed), self.device,
                                           self.hicache, self._capture_graphs(),
                                           num_slots=req_pool.size)
        self.out = OutputProcessor(self.sched, self.kv, self.tokenizer, self.context_length,
                                   self.role)
        self.loop_choice = choose_loop(cfg.requested_loop, self.device)
        log.info("scheduling loop: %s (%s)", self.loop_choice.loop, self.loop_choice.reason)
        self.executor: ThreadedExecutor | InlineExecutor
        self.loop: OverlapLoop | NormalLoop
        if self.loop_choice.overlap:
            self.executor = ThreadedExecutor(runner)
            sync = cfg.consecutive_prefill == "sync" and not self.role.overlap_every_prefill
            self.loop = OverlapLoop(self.sched, self.executor, self.out, sync)
        else:
            inline = InlineExecutor(runner)
            self.executor, self.loop = inline, NormalLoop(self.sched, inline, self.out)
        self.requests: dict[str, Req] = {}
        self.role.attach(RoleContext(self.sched, self.out, self.kv, self.kv_pool,
                                     cfg.max_running_requests, cfg.tp_size, self.tp,
                                     self.loaded.hf_config.num_key_value_heads))

    def _capture_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode batches, captured now, before any request (CUDA, one rank,
        a role that decodes, cuda_graph_max_bs > 0); None otherwise. A failed capture leaves
        them off (reason in /server_info)."""
        cfg = self.cfg
        if (self.device.type != "cuda" or cfg.cuda_graph_max_bs == 0 or self.tp is not None
                or not self.role.runs_decode or cfg.enable_deterministic_inference):
            return None
        context = min(self.context_length, cfg.cuda_graph_max_context)
        graphs = DecodeGraphs(self.loaded.model, self.kv_pool, self.device,
                              min(cfg.cuda_graph_max_bs, cfg.max_running_requests),
                              -(-context // cfg.page_size))
        state = graphs.capture_all()
        log.info("CUDA graphs: %s", state.reason)
        return graphs

    def _make_hicache(self) -> tuple[HostKVPool | None, HiCacheController | None]:
        """The host KV tier and its copy controller, when HiCache is on
        (docs/architecture.md: HiCache)."""
        cfg = self.cfg
        if not cfg.enable_hierarchical_cache:
            return None, None
        if cfg.disable_prefix_cache:
            raise ValueError("--enable-hierarchical-cache needs the prefix cache "
                             "(drop --disable-prefix-cache)")
        pin = self.device.type == "cuda"
        pages = host_pages_for(self.layout, self.kv_pool.num_pages, cfg.hicache_ratio,
                               cfg.hicache_size, pin)
        host = HostKVPool(self.layout, pages, pin)
        log.info("HiCache: host tier of %d pages (%.1f MiB, %.1f MiB of RAM), policy %s", pages,
                 pages * host.page_bytes_all_layers / (1 << 20),
                 host_pool_bytes(self.layout, pages, pin) / (1 << 20), cfg.hicache_write_policy)
        return host, HiCacheController(self.kv_pool, host, self.device)

    def _make_page_store(self) -> PageStore | None:
        """HiCache's storage tier (`--hicache-storage-backend`), keyed under this model's
        identity: its files' names and sizes, its config and the KV layout, so nodes that
        load the same files under any path share pages and no other model can match."""
        cfg = self.cfg
        if not cfg.hicache_storage_backend or self.host_pool is None:
            return None
        storage = make_storage(cfg)
        assert storage is not None  # a backend is named
        path = self.loaded.path
        files = sorted((f.name, f.stat().st_size) for f in path.iterdir() if f.is_file()
                       and f.suffix in (".safetensors", ".bin", ".gguf", ".json"))
        lay = self.layout
        identity = (f"{files}|{lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim}|"
                    f"{lay.dtype}|page {lay.page_size}")
        log.info("HiCache storage: %s", storage.describe())
        return PageStore(storage, self.host_pool, identity)

    def _probe_activations(self) -> int:
        """Activation peak of the largest prompt batch this node admits (device bytes)."""
        model = self.loaded.model
        return probe_activation_peak(model, self.layout, self.device, self.cfg.max_prefill_tokens,
                                     self.cfg.max_running_requests, model.paged_extend())

    @property
    def max_total_tokens(self) -> int:
        return self.kv_pool.num_pages * self.cfg.page_size

    # -- requests ---------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    leg: PDLegFields | None = None, traced: bool = False) -> Req:
        """Validate and hand to the role (colocated: the waiting queue). Raises ValueError
        with a readable message on bad input; `leg` holds a PD leg's fields (the room).
        `traced`: record the request's spans (pdserve/tracing/marks.py)."""
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        params.validate()
        self.check_prompt(prompt_ids, params)
        req = Req(rid, prompt_ids, params, self.loaded.eos_token_ids)
        if traced:
            req.trace = Timeline()
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
        if (grammar := grammar_of(params)) is not None:
            req.grammar = RequestGrammar(self.grammars.start(*grammar), params.resumed_outputs,
                                         self.loaded.eos_token_ids)
            self.compiling.append(req)
        try:
            self.role.add_request(req, leg)
        except BaseException:  # refused (e.g. a PD leg without its room): nothing kept
            if req in self.compiling:
                self.compiling.remove(req)
            raise
        self.requests[rid] = req
        return req

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (PromptError) for a prompt this engine cannot serve."""
        vocab = self.loaded.hf_config.vocab_size
        check_prompt_ids(ids, vocab, self.context_length)
        if params.resumed_outputs > len(ids):
            raise ValueError("resumed_outputs is longer than the prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names token {max(params.logit_bias)}, outside the "
                             f"vocabulary (size {vocab})")
        need = min(len(ids) + params.max_new_tokens, self.context_length)
        if need > self.max_total_tokens:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens "
                             f"({params.max_new_tokens}) needs more KV than the pool holds "
                             f"({self.max_total_tokens} tokens)")

    def num_waiting(self) -> int:
        """Requests queued for prefill (a server bounds this queue)."""
        return len(self.sched.waiting)

    def flush_cache(self) -> None:
        """Drop every unlocked prefix from the cache (in-use prefixes stay)."""
        self.kv.flush()

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None:
            return False
        if req.finished:  # done computing, but the role may still hold it (KV being sent)
            return self.role.abort_held(req)
        req.error = req.error or "aborted"
        self.out.finish(req, "abort")
        return True

    # -- running ------------------------------------------------------------------------
    def has_work(self) -> bool:
        # Finished-but-unreported requests (e.g. an abort while idle) count as work, so the
        # next step() reports them.
        return self.has_runnable() or self.role.has_work() or bool(self.out.finished)

    def has_runnable(self) -> bool:
        """Work the scheduler can do now (as opposed to waiting on a transfer)."""
        return self.sched.has_work() or self.loop.in_flight() > 0

    def poll_role(self) -> bool:
        """Advance the role's queues; True when requests got new output tokens there."""
        try:
            return bool(self.role.poll())
        except Exception:
            log.exception("role poll failed; failing every live request")
            self._fail_all("internal error in the node role")
            raise

    def step(self, role_polled: bool = False) -> list[Req]:
        """One loop iteration; returns the requests that finished in it. `role_polled`:
        the caller ran `poll_role()` just before (to stream what it produced first)."""
        try:
            if not role_polled:
                self.role.poll()
            if self.compiling:
                self._grammars_compiled()
            self.loop.step()
        except Exception:
            log.exception("engine step failed; failing every live request")
            self._fail_all("internal error in the forward pass")
            raise
        done, self.out.finished = self.out.finished, []
        for req in done:
            self.requests.pop(req.rid, None)
        return done

    def _grammars_compiled(self) -> None:
        """Fail the requests whose grammar did not compile (a 400 for their client); the
        others may now sample (`Req.grammar_ready`)."""
        still = []
        for req in self.compiling:
            grammar = req.grammar
            assert grammar is not None  # only requests with a grammar wait here
            if not grammar.ready:
                still.append(req)
            elif (err := grammar.error()) is not None and not req.finished:
                req.error, req.error_code = err, "invalid_grammar"
                self.out.finish(req, "error", cache_it=False)
        self.compiling = still

    def _fail_all(self, message: str) -> None:
        for req in list(self.sched.running) + list(self.sched.waiting):
            req.error = message
            self.out.finish(req, "error", cache_it=False)
        self.loop.discard()
        self.out.mark_idle()

    def run_until_idle(self) -> list[Req]:
        done: list[Req] = []
        while self.has_work():
            done.extend(self.step())
        self.drain()
        return done

    def drain(self) -> None:
        """Process every launched batch's results (the overlap loop may hold some)."""
        self.loop.drain()

    # -- introspection ---------------------------------------------------------------------
    def _kernels_build(self) -> str | None:
        """The fused CPU kernels' build id (`prebuilt-<level>-<hash>`, or the native build's
        cache folder: sources, torch, compiler, CPU flags, checkout), recorded when they
        loaded; None where the torch reference ops run."""
        if self.ops_choice.kind != "native":
            return None
        from pdserve.kernels import build_id

        return build_id()

    def describe(self) -> dict:
        """What this engine runs, for /server_info and logs."""
        return {"loop": self.loop_choice.loop, "loop_reason": self.loop_choice.reason,
                "kernels": self.ops_choice.kind, "kernels_reason": self.ops_choice.reason,
                "kernels_build": self._kernels_build(),
                "attention_backend": self.attn_choice.backend,
                "attention_backend_reason": self.attn_choice.reason,
                "attention": self.runner.attention_paths(),
                "deterministic_inference": self.cfg.enable_deterministic_inference,
                "kv_pool_reason": self.pool_size.reason,
                "cuda_graphs": self.runner.graphs_info(),
                "device": str(self.device), "dtype": str(self.loaded.dtype).removeprefix("torch."),
                "torch_threads": torch.get_num_threads(), "page_size": self.cfg.page_size,
                "tp_size": self.cfg.tp_size, "tp": None if self.tp is None else
                self.tp.describe(self.tp_plan, self.kv_pool.num_pages),
                "max_total_tokens": self.max_total_tokens,
                "hicache": None if self.host_pool is None else {
                    "host_pages": self.host_pool.num_pages,
                    "write_policy": self.cfg.hicache_write_policy,
                    "storage": None if self.page_store is None else
                    self.page_store.describe()}}

    def memory_stats(self) -> dict[str, int]:
        return self.kv.stats()

    def pools_full(self) -> bool:
        """True when no request holds KV or a slot (cached prefixes count as free)."""
        if not self.requests and not self.has_runnable():
            self.kv.drain_copies()  # idle: HiCache copies finish and are acknowledged
        return self.kv.idle_is_full()

    def hicache_stats(self) -> dict:
        """Host tier gauges and counters for /metrics and /server_info ({} when off)."""
        if self.hicache is None:
            return {}
        s = self.kv.stats()
        out: dict[str, Any] = {k: v for k, v in s.items() if k.startswith("host_") or k.endswith(
            ("_evictions", "_ops", "_bytes", "_skipped"))}
        out["host_used_pages"] = s["host_total_pages"] - s["host_free_pages"]
        out["backup_seconds"] = self.hicache.stats["backup_seconds"]
        out["load_seconds"] = self.hicache.stats["load_seconds"]
        out["latency_s"] = self.hicache.latency_histograms()
        if self.page_store is not None:
            out["storage"] = self.page_store.gauges()
        return out

    def close(self) -> None:
        self.grammars.close()
        self.role.close()
        self.executor.close()
        if self.tp is not None:
            self.tp.close()
        self.kv.close()  # storage reads land before the tiers go
        if self.hicache is not None:
            self.hicache.close()
        if self.page_store is not None:  # after the copy thread: it may still be writing
            self.page_store.close()
