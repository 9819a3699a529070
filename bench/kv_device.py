"""KV transfer between two processes whose KV pools live on a device (GPU→GPU on one
machine), through the node's own path: `make_kv_manager`'s choice of memory (the pinned
bounce buffer for tcp; device pointers registered with a CUDA build of Mooncake).

Layout of `synthetic-1b` (16 layers, 8 KV heads, head dim 64, bf16, page 16). Each room is
a prompt of `--tokens` tokens sent in one chunk; GB/s = KV bytes / (send() → the decode
seeing Success). The first room of each backend is checked byte for byte.

    python bench/kv_device.py --device cuda [--backends tcp,mooncake] [--out OUT.json]
    python bench/kv_device.py --device cpu --quick      # the same path on host pools
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import base_parser, print_table, write_json  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, MODEL = 16, 8, 64, 16, "synthetic-1b"


class _Engine:
    """Holds the KV pool that the transfer managers register."""

    def __init__(self, pool) -> None:
        self.kv_pool = pool


def make_engine(device: str, tokens: int, fill: bool) -> _Engine:
    import torch

    from pdserve.memory.kv_pool import KVLayout, KVPool

    pool = KVPool(KVLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16, PAGE), tokens // PAGE,
                  torch.device(device))
    if fill:
        g = torch.Generator(device=device).manual_seed(7)
        for buf in pool.k_buffers + pool.v_buffers:
            raw = buf.view(torch.uint8).view(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=g, device=device,
                                    dtype=torch.uint8))
    return _Engine(pool)


def make_manager(engine: _Engine, role: str, backend: str):
    from kv_transfer import KVTransferConfig
    from pdserve.pd.metadata import MetadataPool
    from pdserve.pd.transfer_setup import make_kv_manager

    meta = MetadataPool(8)
    return make_kv_manager(engine.kv_pool, role, meta, KVTransferConfig(backend=backend),
                           MODEL), meta


def digest(engine: _Engine, pages: list[int]) -> str:
    import torch

    h = hashlib.sha256()
    pool = engine.kv_pool
    for buf in pool.k_buffers + pool.v_buffers:
        raw = buf.view(torch.uint8).reshape(buf.shape[0], -1)
        for p in pages:
            h.update(raw[p * PAGE:(p + 1) * PAGE].cpu().numpy().tobytes())
    return h.hexdigest()


def decode_main(conn, device: str, tokens: int, backend: str) -> None:
    from kv_transfer import KVReceiver

    try:
        engine = make_engine(device, tokens, fill=False)
        mgr, _meta = make_manager(engine, "decode", backend)
        conn.send("ready")
        while True:
            cmd, *a = conn.recv()
            if cmd == "recv":
                room, endpoint, dst = a
                r = KVReceiver(mgr, room, endpoint)
                r.init(dst, 1)
                while not r.poll().terminal:
                    time.sleep(0.0002)
                conn.send((int(r.poll()), r.failure_reason, time.monotonic()))
            elif cmd == "digest":
                conn.send(digest(engine, a[0]))
            else:
                mgr.close()
                conn.send(None)
                return
    except Exception as exc:  # report instead of leaving the parent waiting
        conn.send(("error", repr(exc)))


def recv(conn, timeout: float = 300.0):
    if not conn.poll(timeout):
        raise TimeoutError("decode process did not answer")
    reply = conn.recv()
    if isinstance(reply, tuple) and reply and reply[0] == "error":
        raise RuntimeError(f"decode process: {reply[1]}")
    return reply


def one_room(mgr, conn, room: int, src: list[int], dst: list[int]) -> float:
    from kv_transfer import KVPoll, KVSender
    from pdserve.pd.metadata import pack_row

    conn.send(("recv", room, mgr.endpoint, dst))
    s = KVSender(mgr, room)
    while s.poll() < KVPoll.WaitingForInput:
        if s.poll() == KVPoll.Failed:
            raise RuntimeError(s.failure_reason)
        time.sleep(0.0002)
    s.init(len(src), 0)
    t0 = time.monotonic()
    s.send(src, last=True, metadata=[pack_row(room, 1)])
    state, reason, t_done = recv(conn)
    while not s.poll().terminal:
        time.sleep(0.0002)
    if state != KVPoll.Success or s.poll() != KVPoll.Success:
        raise RuntimeError(f"transfer failed: {reason or s.failure_reason}")
    return t_done - t0


def run_backend(backend: str, device: str, tokens: int, pool_tokens: int, rooms: int) -> dict:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode_main, args=(child, device, pool_tokens, backend),
                       daemon=True)
    proc.start()
    try:
        engine = make_engine(device, pool_tokens, fill=True)
        mgr, _meta = make_manager(engine, "prefill", backend)
        assert recv(conn) == "ready"
        pages = tokens // PAGE
        nbytes = pages * 2 * LAYERS * engine.kv_pool.layout.page_bytes
        times, exact = [], None
        for i in range(rooms + 1):  # room 0 warms up (connections, bounce buffers)
            src = list(range(i % 2 * pages, i % 2 * pages + pages))
            dst = list(range(pages * (i % 3), pages * (i % 3) + pages))
            t = one_room(mgr, conn, 1000 + i, src, dst)
            if i == 0:
                conn.send(("digest", dst))
                exact = recv(conn) == digest(engine, src)
            else:
                times.append(t)
        conn.send(("close",))
        recv(conn)
        mgr.close()
        med = statistics.median(times)
        return {"backend": backend, "device": device, "tokens": tokens, "rooms": rooms,
                "mbytes": round(nbytes / 1e6, 2), "median_ms": round(1000 * med, 3),
                "gb_s": round(nbytes / med / 1e9, 3), "byte_exact": exact,
                "staged": getattr(mgr.memory, "staged", False)}
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cpu|cuda[:N] of both pools")
    parser.add_argument("--backends", default="tcp,mooncake",
                        help="comma list; a backend refused by the node's start-up check is "
                             "reported and skipped")
    parser.add_argument("--tokens", type=int, default=0,
                        help="prompt tokens per room (0: 512 with --quick, else 4096)")
    parser.add_argument("--rooms", type=int, default=0, help="measured rooms (0: 3 / 10)")
    args = parser.parse_args()
    from kv_transfer import mooncake_import_error
    from kv_transfer.compat import TransferFacts, installed_mooncake_builds, transfer_refusal

    tokens = args.tokens or (512 if args.quick else 4096)
    rooms = args.rooms or (3 if args.quick else 10)
    rows, refused = [], {}
    for backend in args.backends.split(","):
        import torch

        facts = TransferFacts(torch.device(args.device).type, backend,
                              installed_mooncake_builds(),
                              mooncake_import_error() if backend == "mooncake" else None,
                              torch.version.cuda)
        if (why := transfer_refusal(facts)) is not None:
            print(f"  {backend}: refused: {why}")
            refused[backend] = why
            continue
        rows.append(run_backend(backend, args.device, tokens, 3 * tokens, rooms))
        print(f"  {backend}: {rows[-1]['gb_s']} GB/s")
    print_table(rows, ["backend", "device", "tokens", "mbytes", "median_ms", "gb_s",
                       "byte_exact", "staged"])
    summary = {f"kv_gb_s_{r['backend']}": r["gb_s"] for r in rows}
    summary.update({f"byte_exact_{r['backend']}": r["byte_exact"] for r in rows})
    summary["refused"] = refused
    summary["device"] = args.device
    write_json(args.out, summary, rows, args)
    if not all(r["byte_exact"] for r in rows):
        raise SystemExit("a transfer was not byte-exact")


if __name__ == "__main__":
    main()
