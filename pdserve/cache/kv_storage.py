"""HiCache's third tier: KV pages in storage, below device and host memory
(docs/architecture.md: HiCache storage).

A stored object is one page over every layer (K then V of layer 0, then layer 1, ...), named
by its **prefix-hash chain**: key(page i) = sha256(key(page i-1) || token ids of page i),
key(page -1) = sha256(identity), where the identity names the model, dtype, page size and KV
layout. Equal keys mean equal tokens from position 0 under the same model, so any node of
the same model that finds a key may use the page: a prefix computed on one node is a hit
on another that shares the storage.

Every object carries a checksum of its payload; a page that fails it, or is missing, ends
the lookup there and the rest is recomputed: storage never yields wrong KV. Storage that
fails (a full disk, a vanished folder) is counted and skipped: the node serves without it.

`FileStorage` keeps one file per page under a folder (local disk, or a shared file system
for several nodes); writes are atomic (temporary file, then rename). `MooncakeStorage` keeps
them in a Mooncake Store: a `mooncake_master` plus the memory segment each node mounts, so
nodes on different hosts share pages over the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import threading
import time
import zlib
from array import array
from pathlib import Path
from urllib.parse import urlsplit

import torch

from pdserve.cache.latency import LatencyHistogram
from pdserve.memory.host_pool import HostKVPool

log = logging.getLogger(__name__)

_MAGIC = b"PDKV1\0"
_HEADER = struct.Struct("<6sIQ")  # magic, crc32 of the payload, payload length


def page_keys(identity: str, tokens: list[int], page_size: int, n_pages: int) -> list[str]:
    """Hex keys of the first `n_pages` whole pages of `tokens` (the prefix-hash chain)."""
    prev = hashlib.sha256(identity.encode()).digest()
    keys = []
    for i in range(n_pages):
        page = array("i", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        prev = hashlib.sha256(prev + page).digest()
        keys.append(prev.hex())
    return keys


def pack(payload: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, zlib.crc32(payload), len(payload)) + payload


def unpack(data: bytes) -> bytes:
    """The payload of a stored object; ValueError when it fails its check."""
    if len(data) < _HEADER.size:
        raise ValueError("truncated object")
    magic, crc, length = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != _MAGIC or length != len(payload) or zlib.crc32(payload) != crc:
        raise ValueError("checksum mismatch")
    return payload


class FileStorage:
    """Objects as files `<root>/<key[:2]>/<key>`; thread-safe (each call is self-contained)."""

    name = "file"

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def put(self, key: str, payload: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(pack(payload))
        os.replace(tmp, path)

    def get(self, key: str) -> bytes | None:
        """The payload, or None when missing; raises ValueError when it fails its check."""
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return unpack(data)

    up = True  # a folder has no connection to lose; failures show per operation

    def describe(self) -> dict:
        return {"backend": self.name, "path": str(self.root)}

    def close(self) -> None:
        pass


class MooncakeStorage:
    """Objects in a Mooncake Store (`mooncake_master` plus every node's mounted segment of
    `segment_mb` MiB): nodes of one model that name the same master share pages. The client
    connects on a thread of its own once the master answers, retrying every `RETRY_S`; until
    then, and for `RETRY_S` after an operation fails, every operation raises OSError at
    once: the node serves from its other tiers."""

    name = "mooncake"
    RETRY_S = 10.0

    def __init__(self, master: str, metadata_url: str, host: str, segment_mb: int,
                 protocol: str) -> None:
        self.master, self.metadata_url = master, metadata_url
        self._args = (host, metadata_url, segment_mb << 20, 64 << 20, protocol, "", master)
        self._store = None
        self._down_until = 0.0
        self._closed = threading.Event()
        threading.Thread(target=self._connect, name="pdserve-kv-storage", daemon=True).start()

    def _connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        while not self._closed.is_set():
            if not self._reachable():
                log.warning("HiCache storage: Mooncake master %s or its metadata server %s "
                            "refuses connections; retrying in %.0f s", self.master,
                            self.metadata_url, self.RETRY_S)
                self._closed.wait(self.RETRY_S)
                continue
            store = MooncakeDistributedStore()
            rc = store.setup(*self._args)
            if rc == 0:
                if self._closed.is_set():
                    store.close()
                else:
                    self._store = store
                    log.info("HiCache storage: connected to Mooncake master %s", self.master)
                return
            log.warning("HiCache storage: Mooncake master %s unreachable (rc %s); retrying "
                        "in %.0f s", self.master, rc, self.RETRY_S)
            self._closed.wait(self.RETRY_S)

    def _reachable(self) -> bool:
        """Both of the master's ports accept a connection. `setup` holds the GIL while it
        waits (about 90 s for an absent master), which would stall the whole node: it is
        only called once this cheap check passed."""
        meta = urlsplit(self.metadata_url)
        host, _, port = self.master.rpartition(":")
        for addr in ((host, int(port)), (meta.hostname or "", meta.port or 80)):
            try:
                socket.create_connection(addr, timeout=1.0).close()
            except OSError:
                return False
        return True

    @property
    def up(self) -> bool:
        return self._store is not None and time.monotonic() >= self._down_until

    def _client(self):
        if self._store is None:
            raise OSError(f"not connected to the Mooncake master {self.master}")
        if time.monotonic() < self._down_until:
            raise OSError(f"the Mooncake master {self.master} failed recently")
        return self._store

    def _failed(self, what: str, rc: int) -> OSError:
        self._down_until = time.monotonic() + self.RETRY_S
        return OSError(f"Mooncake Store {what} failed (rc {rc})")

    def exists(self, key: str) -> bool:
        rc = self._client().is_exist(key)
        if rc < 0:
            raise self._failed("is_exist", rc)
        return rc == 1

    def put(self, key: str, payload: bytes) -> None:
        rc = self._client().put(key, pack(payload))
        if rc != 0:
            raise self._failed("put", rc)

    def get(self, key: str) -> bytes | None:
        data = self._client().get(key)
        return unpack(data) if data else None

    def describe(self) -> dict:
        return {"backend": self.name, "master": self.master, "metadata_url": self.metadata_url}

    def close(self) -> None:
        self._closed.set()
        if self._store is not None:
            self._store.close()
            self._store = None


Storage = FileStorage | MooncakeStorage


class PageStore:
    """Host pages <-> storage objects, with the counters `/metrics` shows. `save` runs on the
    HiCache copy thread, `available` and `load` on the storage prefetch thread."""

    def __init__(self, storage: Storage, host: HostKVPool, identity: str) -> None:
        self.storage, self.host, self.identity = storage, host, identity
        self._lock = threading.Lock()
        # per call: one backup's pages written, one admission's pages read
        self.latency = {"write": LatencyHistogram(), "read": LatencyHistogram()}
        self.stats = {"storage_hit_pages": 0, "storage_miss_lookups": 0,
                      "storage_corrupt_pages": 0, "storage_errors": 0,
                      "storage_prefetch_timeouts": 0,
                      "storage_written_pages": 0, "storage_write_bytes": 0,
                      "storage_read_bytes": 0, "storage_read_seconds": 0.0,
                      "storage_write_seconds": 0.0}

    def describe(self) -> dict:
        return self.storage.describe()

    def gauges(self) -> dict:
        """Counters, the up gauge and latency histograms (msgpack-safe)."""
        return {**self.stats, "storage_up": int(self.storage.up),
                "latency_s": {k: h.snapshot() for k, h in self.latency.items()}}

    def close(self) -> None:
        self.storage.close()

    def count(self, **inc) -> None:
        with self._lock:
            for k, v in inc.items():
                self.stats[k] += v

    def keys(self, tokens: list[int], n_pages: int) -> list[str]:
        return page_keys(self.identity, tokens, self.host.page_size, n_pages)

    # -- one page's bytes ---------------------------------------------------------------
    def _views(self, host_page: int) -> list[torch.Tensor]:
        """The page's K and V rows of every layer, as flat byte tensors (views, no copy)."""
        out = []
        for k, v in zip(self.host.k_buffers, self.host.v_buffers, strict=True):
            out.append(self.host.page_view(k)[host_page].view(torch.uint8).view(-1))
            out.append(self.host.page_view(v)[host_page].view(torch.uint8).view(-1))
        return out

    def _payload(self, host_page: int) -> bytes:
        return b"".join(t.numpy().tobytes() for t in self._views(host_page))

    def _fill(self, host_page: int, payload: bytes) -> None:
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        off = 0
        for view in self._views(host_page):
            view.copy_(src[off:off + view.numel()])
            off += view.numel()

    # -- tier operations ------------------------------------------------------------------
    def save(self, keys: list[str], host_pages: list[int]) -> None:
        """Write the pages storage lacks (copy thread, right after their backup)."""
        t0, written, nbytes = time.perf_counter(), 0, 0
        try:
            for key, page in zip(keys, host_pages, strict=True):
                if self.storage.exists(key):
                    continue
                payload = self._payload(page)
                self.storage.put(key, payload)
                written, nbytes = written + 1, nbytes + len(payload)
        except OSError as exc:
            log.warning("HiCache storage: write failed (%s); serving without it", exc)
            self.count(storage_errors=1)
        seconds = time.perf_counter() - t0
        self.count(storage_written_pages=written, storage_write_bytes=nbytes,
                    storage_write_seconds=seconds)
        if written:
            self.latency["write"].observe(seconds)

    def available(self, keys: list[str]) -> int:
        """How many leading keys storage holds (a lookup that ends at the first miss)."""
        n = 0
        try:
            while n < len(keys) and self.storage.exists(keys[n]):
                n += 1
        except OSError:
            self.count(storage_errors=1)
        if n < len(keys):
            self.count(storage_miss_lookups=1)
        return n

    def load(self, keys: list[str], host_pages: list[int]) -> int:
        """Read the objects into host pages, in order; returns how many leading pages were
        read and verified (a missing or corrupt object ends it)."""
        t0, ok, nbytes = time.perf_counter(), 0, 0
        for key, page in zip(keys, host_pages, strict=True):
            try:
                payload = self.storage.get(key)
            except ValueError as exc:
                log.warning("HiCache storage: object %s… refused (%s); recomputing", key[:12],
                            exc)
                self.count(storage_corrupt_pages=1)
                break
            except OSError as exc:
                log.warning("HiCache storage: read failed (%s); recomputing", exc)
                self.count(storage_errors=1)
                break
            if payload is None or len(payload) != self.host.page_bytes_all_layers:
                if payload is not None:
                    self.count(storage_corrupt_pages=1)
                break
            self._fill(page, payload)
            ok, nbytes = ok + 1, nbytes + len(payload)
        seconds = time.perf_counter() - t0
        self.count(storage_hit_pages=ok, storage_read_bytes=nbytes,
                    storage_read_seconds=seconds)
        self.latency["read"].observe(seconds)
        return ok


def make_storage(cfg) -> Storage | None:
    """The storage tier an `EngineConfig` asks for (None: off)."""
    backend = cfg.hicache_storage_backend
    if not backend:
        return None
    if backend == "file":
        return FileStorage(cfg.hicache_storage_path)
    if backend == "mooncake":
        master = cfg.hicache_mooncake_master
        url = cfg.hicache_mooncake_metadata_url or \
            f"http://{master.rsplit(':', 1)[0]}:8080/metadata"
        return MooncakeStorage(master, url, cfg.hicache_mooncake_host,
                               cfg.hicache_mooncake_segment_mb, cfg.hicache_mooncake_protocol)
    raise ValueError(f"unknown HiCache storage backend {backend!r}")
