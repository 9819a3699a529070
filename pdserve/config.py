"""Engine configuration: one frozen dataclass, built once (from the CLI or `LLM(**kw)`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.flags import add_dataclass_flags, values_from

if TYPE_CHECKING:  # torch is imported lazily: light processes (registry, router) skip it
    import torch


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine core. Each field is one `--flag` on the node CLIs."""

    model: str = "tiny-llama"
    dtype: str = "auto"  # auto = float32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"  # auto = cuda when available, else cpu
    kernels: str = "auto"  # auto | native | torch (see pdserve/models/ops.py)
    # auto | triton | native | torch (see pdserve/models/attention_backends.py)
    attention_backend: str = "auto"
    page_size: int = 16
    max_running_requests: int = 64
    max_total_tokens: int = 0  # KV pool size in tokens; 0 = derive from --kv-cache-mb
    kv_cache_mb: int = 0  # 0 = --mem-fraction-static on CUDA, 512 MiB on CPU
    mem_fraction_static: float = 0.85  # CUDA: share of the device for weights + KV + activations
    context_length: int = 0  # 0 = the model's max_position_embeddings
    chunked_prefill_size: int = 2048  # tokens of one request per prefill batch; 0 = no chunking
    # Token budget of one prefill batch. 2048 (vLLM's CPU server default too): a wave of
    # prompts is served in shorter steps, so the first ones get their first token sooner
    # and running decodes (mixed rows) wait less; measured in docs/architecture.md.
    max_prefill_tokens: int = 2048
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest prefix match first)
    disable_prefix_cache: bool = False
    loop: str = "auto"  # auto | overlap | normal (see pdserve/engine/loop_choice.py)
    disable_overlap: bool = False  # same as loop="normal" (SGLang's flag name)
    # overlap | sync: the overlap loop before a prefill batch that follows a prefill batch.
    # sync by measurement on CPU colocated nodes (bench/prefill_overlap.py, tiny-llama:
    # overlapping them gave lower tokens/s in 6 of 8 runs, median 0.90x, and no TTFT gain,
    # median ratio 1.0; smollm2-135m: no difference beyond noise). A prefill node always
    # overlaps.
    consecutive_prefill: str = "sync"
    decode_reserve_tokens: int = 64  # future decode tokens reserved per running request
    # extend batches carry no decode rows (prefill steps stall the running requests)
    disable_mixed_batches: bool = False
    seed: int = 0
    model_cache_dir: str = ""  # where built-in models are converted/generated; "" = user cache
    revision: str = ""  # Hub models (ORG/NAME): branch, tag or commit; "" = main
    load_format: str = "auto"  # auto: the checkpoint's safetensors; dummy: random weights
    # HiCache: a host-memory KV tier behind the radix cache (docs/architecture.md: HiCache).
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pages / device pages (when hicache_size is 0)
    hicache_size: float = 0.0  # host tier in GiB; 0 = from hicache_ratio
    hicache_write_policy: str = "write_through"
    # HiCache's storage tier under the host tier ("" off; "file": one file per page under
    # hicache_storage_path, which nodes of one model may share).
    hicache_storage_backend: str = ""
    hicache_storage_path: str = ""
    # The longest a waiting request waits for its storage read before it is computed
    # instead (a stalled storage must not hold the queue); 0: no limit.
    hicache_storage_prefetch_timeout_s: float = 10.0
    # mooncake: the master's RPC address, its HTTP metadata server (default: the master's
    # host, port 8080), this node's address for the store, the memory it lends the store.
    hicache_mooncake_master: str = ""
    hicache_mooncake_metadata_url: str = ""
    hicache_mooncake_host: str = "127.0.0.1"
    hicache_mooncake_segment_mb: int = 1024
    hicache_mooncake_protocol: str = "tcp"
    tp_size: int = 1  # ranks of this node (docs/architecture.md: Tensor parallelism)
    # Forward (torch intra-op) threads; 0 = torch's default, one per core. `pdserve up`
    # splits the cores between the nodes it starts (docs/architecture.md: CPU threads).
    threads: int = 0
    # CUDA graphs of decode batches (docs/architecture.md: CUDA graphs): batches of up to
    # this many rows (0: off) whose context fits cuda_graph_max_context tokens replay a graph
    # captured at start-up; others run eagerly. CUDA nodes of one rank only.
    cuda_graph_max_bs: int = 64
    cuda_graph_max_context: int = 4096
    # Batch-invariant ops (SGLang's flag name): a request's tokens and logprobs are the same
    # bits whatever else runs with it (pdserve/models/batch_invariant.py).
    enable_deterministic_inference: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.chunked_prefill_size < 0 or self.max_prefill_tokens < 1:
            raise ValueError("chunked_prefill_size must be >= 0 and max_prefill_tokens >= 1")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm, got {self.schedule_policy!r}")
        if self.consecutive_prefill not in ("overlap", "sync"):
            raise ValueError("consecutive_prefill must be overlap or sync, got "
                             f"{self.consecutive_prefill!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto|bfloat16|float16|float32, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto|dummy, got {self.load_format!r}")
        if self.kernels not in ("auto", "native", "torch"):
            raise ValueError(f"kernels must be auto|native|torch, got {self.kernels!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got "
                             f"{self.mem_fraction_static}")
        if self.kv_cache_mb < 0 or self.max_total_tokens < 0:
            raise ValueError("kv_cache_mb and max_total_tokens must be >= 0")
        if self.attention_backend not in ("auto", "triton", "native", "torch"):
            raise ValueError("attention_backend must be auto|triton|native|torch, got "
                             f"{self.attention_backend!r}")
        if self.loop not in ("auto", "overlap", "normal"):
            raise ValueError(f"loop must be auto|overlap|normal, got {self.loop!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto|cpu|cuda[:N], got {self.device!r}")
        self._check_hicache()
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: one per core), got {self.threads}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.cuda_graph_max_bs < 0 or self.cuda_graph_max_context < 1:
            raise ValueError("cuda_graph_max_bs must be >= 0 and cuda_graph_max_context >= 1")
        if self.tp_size > 1 and self.enable_deterministic_inference:
            raise ValueError("--enable-deterministic-inference does not support --tp-size > 1")
        if self.tp_size > 1 and self.enable_hierarchical_cache:
            raise ValueError("--enable-hierarchical-cache does not support --tp-size > 1 yet")

    def _check_hicache(self) -> None:
        if not self.hicache_ratio > 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")
        if not self.hicache_size >= 0:
            raise ValueError(f"hicache_size must be >= 0 GiB, got {self.hicache_size}")
        if self.hicache_write_policy not in HICACHE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {'|'.join(HICACHE_POLICIES)}"
                             f", got {self.hicache_write_policy!r}")
        if self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            raise ValueError("hicache_storage_backend must be file or mooncake (or empty: off), "
                             "got "
                             f"{self.hicache_storage_backend!r}")
        if not self.hicache_storage_prefetch_timeout_s >= 0:
            raise ValueError("hicache_storage_prefetch_timeout_s must be >= 0, got "
                             f"{self.hicache_storage_prefetch_timeout_s}")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        if self.hicache_storage_backend == "file" and not self.hicache_storage_path:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-path")
        if self.hicache_storage_backend == "mooncake":
            host, _, port = self.hicache_mooncake_master.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError("--hicache-storage-backend mooncake needs "
                                 "--hicache-mooncake-master HOST:PORT")
            if self.hicache_mooncake_segment_mb < 1:
                raise ValueError("hicache_mooncake_segment_mb must be >= 1")
            if self.hicache_mooncake_protocol not in ("tcp", "rdma"):
                raise ValueError("hicache_mooncake_protocol must be tcp or rdma")
        if self.hicache_size:
            have = physical_memory_bytes()
            if have and self.hicache_size * (1 << 30) > have * 0.9:
                raise ValueError(f"hicache_size {self.hicache_size} GiB does not fit this "
                                 f"machine's memory ({have / (1 << 30):.1f} GiB)")

    @property
    def requested_loop(self) -> str:
        """The loop asked for: `disable_overlap` wins over `loop` (it only forces normal)."""
        return "normal" if self.disable_overlap else self.loop

    def torch_device(self) -> torch.device:
        """The engine's device; CUDA always with its index (`devices.resolve_torch_device`)."""
        from pdserve.devices import resolve_torch_device  # the one place `auto` is decided

        return resolve_torch_device(self.device)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Register one flag per field (booleans as store_true)."""
        add_dataclass_flags(parser, cls, "engine", help=_HELP, show_default=True)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**values_from(cls, args))


def physical_memory_bytes() -> int:
    """Total RAM of this machine (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


HICACHE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_STORAGE_BACKENDS = ("", "file", "mooncake")

_HELP = {
    "model": "built-in name (smollm2-135m, tiny-llama, tiny-qwen2), a local HF folder, or "
             "a Hugging Face Hub repository id ORG/NAME (downloaded into the Hub cache; "
             "HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply)",
    "dtype": "weight and KV dtype: auto|bfloat16|float16|float32",
    "device": "auto|cpu|cuda[:N]",
    "kernels": "decoder-layer ops: native (fused CPU kernels: prebuilt for this CPU's ISA "
               "level, or built once with the C++ compiler), torch (plain PyTorch), or auto "
               "(native on CPU when they load, else torch)",
    "attention_backend": "attention of decode and prompt rows: triton (paged Triton "
                         "kernels; CUDA, or CPU under TRITON_INTERPRET=1), native (the fused "
                         "CPU kernels), torch (SDPA over gathered pages), or auto (triton on "
                         "CUDA, native on CPU with the fused kernels, else torch)",
    "threads": "forward threads of this node (torch intra-op; 0: one per core). Nodes "
               "sharing a machine should split its cores: `pdserve up` does",
    "page_size": "tokens per KV page",
    "max_running_requests": "most requests in the running batch",
    "max_total_tokens": "KV pool size in tokens (0: from --kv-cache-mb)",
    "kv_cache_mb": "KV pool size in MiB when --max-total-tokens is 0 (0: on CUDA from "
                   "--mem-fraction-static, on CPU 512 MiB)",
    "mem_fraction_static": "CUDA nodes, when --kv-cache-mb and --max-total-tokens are 0: the "
                           "share of the GPU's memory for weights, KV pool and activations "
                           "(SGLang's meaning); the pool gets what is left after the weights "
                           "and the measured peak of the largest prompt batch",
    "context_length": "longest prompt+output (0: model's limit)",
    "chunked_prefill_size": "most prompt tokens of one request per prefill batch (0: off)",
    "max_prefill_tokens": "token budget of one prefill batch",
    "schedule_policy": "fcfs or lpm (longest prefix match first)",
    "disable_prefix_cache": "turn the radix prefix cache off",
    "loop": "scheduling loop: overlap (CPU builds batch N+1 while N runs), normal, or auto "
            "(overlap on GPUs and when a CPU core is free for the scheduler, else normal)",
    "disable_overlap": "use the normal loop (same as --loop normal)",
    "consecutive_prefill": "overlap loop, a prefill batch right after a prefill batch: "
                           "'overlap' launches it before the previous result is processed, "
                           "'sync' processes that result first (its first tokens go out "
                           "before the next prefill runs; default). Prefill nodes always overlap",
    "decode_reserve_tokens": "KV tokens reserved per running request for future decode steps",
    "disable_mixed_batches": "never put the running requests' decode rows into a prefill "
                             "batch (by default a prefill batch also advances every running "
                             "request by one token, so prompts do not stall decoding)",
    "seed": "seed of the engine's sampler for unseeded requests",
    "model_cache_dir": "where built-in models are converted/generated and, when set, Hub "
                       "models are downloaded (<dir>/hub; default: the user cache and "
                       "the Hub cache)",
    "revision": "Hub models: the branch, tag or commit to load (empty: main)",
    "load_format": "auto: read the checkpoint's safetensors; dummy: random weights of the "
                   "checkpoint's shape, the same on every node (benchmarks without "
                   "downloading weights)",
    "enable_hierarchical_cache": "HiCache: keep evicted prefix KV in a host-memory tier and "
                                 "load it back instead of recomputing",
    "hicache_ratio": "host KV tier size as a multiple of the device KV pool (> 0)",
    "hicache_size": "host KV tier size in GiB (0: use --hicache-ratio)",
    "hicache_write_policy": "when cached KV is copied to the host tier: write_through (on "
                            "insert), write_through_selective (once hit twice), write_back "
                            "(on device eviction)",
    "hicache_storage_backend": "HiCache storage tier under the host tier: file (one file "
                               "per page under --hicache-storage-path) or mooncake (a "
                               "Mooncake Store); pages written behind their host copy, "
                               "read back on a miss, checked; nodes of one model sharing "
                               "it share prefixes; empty: off",
    "hicache_storage_path": "folder of the file storage tier",
    "hicache_storage_prefetch_timeout_s": "longest a waiting request waits for its prefix "
                                          "to be read from the storage tier before it is "
                                          "computed instead; while a read that timed out "
                                          "is still stuck, storage is not read (0: no "
                                          "limit)",
    "hicache_mooncake_master": "mooncake storage tier: the mooncake_master's RPC address "
                               "HOST:PORT",
    "hicache_mooncake_metadata_url": "mooncake storage tier: the master's HTTP metadata "
                                     "server (empty: http://MASTER_HOST:8080/metadata)",
    "hicache_mooncake_host": "mooncake storage tier: this node's address the other store "
                             "clients reach",
    "hicache_mooncake_segment_mb": "mooncake storage tier: memory (MiB) this node lends "
                                   "the store",
    "hicache_mooncake_protocol": "mooncake storage tier: tcp or rdma",
    "enable_deterministic_inference": "batch-invariant ops: a request's tokens and logprobs "
                                      "are the same bits whatever else is in its batches, "
                                      "however its prompt is chunked, colocated or "
                                      "disaggregated (slower: docs/serving.md)",
    "cuda_graph_max_bs": "CUDA: decode batches of up to this many requests replay CUDA graphs "
                         "captured at start-up (one per row and context bucket; 0: off). "
                         "Ignored on CPU and with --tp-size > 1",
    "cuda_graph_max_context": "CUDA: longest context (tokens) a graph-replayed decode batch "
                              "may have; longer batches run eagerly",
    "tp_size": "tensor-parallel ranks of this node: rank 0 schedules, ranks 1..N-1 are worker "
               "processes (gloo on CPU, NCCL on CUDA: one GPU per rank); must divide the "
               "attention heads",
}
