"""In-process PD harness: prefill and decode engines in the test process, each with its real
TransferManager (real Mooncake / tcp transfers over loopback), stepped by the test.

A `PDCluster` holds any number of prefill and decode engines of one model and one transfer
backend (1P1D, 1P2D, 2P1D, ...). `submit` sends a request's two legs the way the router
does (same prompt, same room, the decode leg naming the prefill's KV endpoint); `run`
steps every engine until all are idle, failing with a readable dump when a deadline
passes. `problems` lists everything that is not back to full on an engine (KV pages,
request slots, metadata slots, role queues).

Engine construction is dominated by loading the tokenizer (~0.7 s) and the weights (seconds
for smollm2-135m); `make_engine` shares both per model, patched in only while an engine
is being built.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import random
import time
from dataclasses import dataclass

import torch

import pdserve.engine.engine as engine_mod
from decode_node.role import DecodeRole
from kv_transfer import KVTransferConfig
from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.request import Req
from pdserve.pd.leg import PDLegFields
from prefill_node.role import PrefillRole

BACKENDS = ("mooncake", "tcp")
TINY_MODELS = ("tiny-llama", "tiny-qwen2")
SMOLLM = "smollm2-135m"
# Small KV pools: the default 512 MiB per engine would add up over dozens of engines.
# The overlap loop is explicit (auto picks normal on a 2-core CPU); disable_overlap=True
# still selects the normal loop.
MODEL_DEFAULTS: dict[str, dict] = {
    "tiny-llama": {"max_total_tokens": 8192, "loop": "overlap"},
    "tiny-qwen2": {"max_total_tokens": 8192, "loop": "overlap"},
    SMOLLM: {"max_total_tokens": 2048, "dtype": "float32", "loop": "overlap"},
}

# -- engines ------------------------------------------------------------------------------

_real_load_tokenizer = engine_mod.load_tokenizer
_real_load_model = engine_mod.load_model


@functools.cache
def _tokenizer(path: str):
    return _real_load_tokenizer(path)


@functools.cache
def _loaded(name: str, dtype: str, device: str, *where: str):
    return _real_load_model(name, dtype, torch.device(device), *where)


def _model(name: str, dtype: str, device: str, *where: str):
    # A shallow copy per engine: the weights are shared, but each engine sets its own
    # `model.ops` (its --kernels / --attention-backend choice). `where`: cache dir,
    # revision, load format, as the engine passes them.
    loaded = _loaded(name, dtype, device, *where)
    return dataclasses.replace(loaded, model=copy.copy(loaded.model))


@contextlib.contextmanager
def _shared_tokenizer(share_model: bool = True):
    """While an engine is built: one tokenizer and one set of weights per model, shared by
    every engine of the session (the forward only reads the weights; KV pools, schedulers
    and transfer state stay per engine). A TP engine shards its model in place, so it
    loads its own (`share_model=False`)."""
    engine_mod.load_tokenizer = lambda path: _tokenizer(str(path))
    if share_model:
        engine_mod.load_model = lambda name, dtype, device, *where: _model(
            name, dtype, str(device), *where)
    try:
        yield
    finally:
        engine_mod.load_tokenizer = _real_load_tokenizer
        engine_mod.load_model = _real_load_model


def engine_config(model: str, **cfg) -> EngineConfig:
    return EngineConfig(model=model, **{**MODEL_DEFAULTS.get(model, {}), **cfg})


def make_engine(model: str, role=None, **cfg) -> Engine:
    with _shared_tokenizer(share_model=cfg.get("tp_size", 1) == 1):
        return Engine(engine_config(model, **cfg), role)


def transfer_config(backend: str, **kw) -> KVTransferConfig:
    return KVTransferConfig(backend=backend, **kw)


# -- references ---------------------------------------------------------------------------

_LLMS: dict[str, LLM] = {}


def colocated(model: str) -> LLM:
    """The colocated engine of `model` with its default configuration (built once). It
    loads its own weights: a PD engine that wrote into the shared ones (they are only read,
    but that is what a reference must not take on trust) would corrupt its reference too."""
    if model not in _LLMS:
        with _shared_tokenizer(share_model=False):
            _LLMS[model] = LLM(model, **MODEL_DEFAULTS.get(model, {}))
    return _LLMS[model]


_REF: dict[tuple, tuple[int, ...]] = {}


def colocated_greedy(model: str, prompts, n: int) -> list[list[int]]:
    """Greedy outputs (ignore_eos, `n` tokens) of the colocated engine, memoized."""
    todo = [tuple(p) for p in prompts if (model, tuple(p), n) not in _REF]
    todo = list(dict.fromkeys(todo))
    if todo:
        outs = colocated(model).generate([list(p) for p in todo], greedy(n))
        for p, o in zip(todo, outs, strict=True):
            assert o.finish_reason == "length", o
            _REF[(model, p, n)] = tuple(o.output_ids)
    return [list(_REF[(model, tuple(p), n)]) for p in prompts]


def close_references() -> None:
    for llm in _LLMS.values():
        llm.close()
    _LLMS.clear()
    _REF.clear()
    _loaded.cache_clear()
    _tokenizer.cache_clear()  # the transformers references: tests/conftest.py drops them


# -- prompts ------------------------------------------------------------------------------


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    """n ordinary token ids (ids below 100 are SmolLM2's special and byte tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


# -- the cluster ----------------------------------------------------------------------------

_rooms = itertools.count(random.Random().getrandbits(40) << 20)
_rids = itertools.count()


@dataclass
class Leg2:
    """The two legs of one PD request."""

    rid: str
    room: int
    prefill: Req | None
    decode: Req | None
    p: int
    d: int

    @property
    def output_ids(self) -> list[int]:
        assert self.decode is not None
        return list(self.decode.output_ids)


class PDCluster:
    def __init__(self, model: str, backend: str, prefills: list[dict] | None = None,
                 decodes: list[dict] | None = None, transfer: dict | None = None,
                 early_send: bool = True) -> None:
        self.model, self.backend = model, backend
        tc = transfer_config(backend, **(transfer or {}))
        self.prefills: list[Engine] = []
        self.decodes: list[Engine] = []
        try:
            for cfg in prefills or [{}]:
                self.prefills.append(make_engine(model, PrefillRole(tc, model, early_send),
                                                 **cfg))
            for cfg in decodes or [{}]:
                self.decodes.append(make_engine(model, DecodeRole(tc, model), **cfg))
        except BaseException:
            self.close()
            raise
        self.legs: list[Leg2] = []

    @property
    def engines(self) -> list[Engine]:
        return self.prefills + self.decodes

    def endpoint(self, p: int = 0) -> str:
        return self.prefills[p].role.mgr.endpoint

    def kv_endpoints(self, p: int) -> tuple[str, ...]:
        """What the decode leg names of prefill `p` (every rank's endpoint on a TP node)."""
        if self.prefills[p].cfg.tp_size > 1:
            return tuple(self.prefills[p].role.registry_fields()["kv_endpoints"])
        return (self.endpoint(p),)

    # -- requests --------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams, p: int = 0, d: int = 0,
               room: int | None = None, legs: str = "pd") -> Leg2:
        """Send the request to prefill `p` and decode `d` (each leg gets its own copy of
        the sampling params: the prefill role rewrites max_new_tokens)."""
        room = next(_rooms) if room is None else room
        rid = f"pd-{next(_rids)}"
        preq = dreq = None
        if "p" in legs:
            d_tp = self.decodes[d].cfg.tp_size if self.decodes else 1
            # As the router: the decode's TP size only when KV is sliced by heads.
            p_leg = PDLegFields(bootstrap_room=room, decode_tp_size=(
                d_tp if d_tp != self.prefills[p].cfg.tp_size else None))
            preq = self.prefills[p].add_request(rid, list(prompt), SamplingParams(**vars(params)),
                                                p_leg)
        if "d" in legs:
            dreq = self.decodes[d].add_request(
                rid, list(prompt), SamplingParams(**vars(params)),
                PDLegFields(bootstrap_room=room, prefill_kv_endpoints=self.kv_endpoints(p)))
        leg = Leg2(rid, room, preq, dreq, p, d)
        self.legs.append(leg)
        return leg

    def generate(self, prompts, params: SamplingParams, p=0, d=0, timeout: float = 60.0
                 ) -> list[Leg2]:
        """Submit every prompt (to prefill p / decode d; ints or per-prompt lists), run
        until idle, and check every leg succeeded."""
        n = len(prompts)
        ps = p if isinstance(p, list) else [p] * n
        ds = d if isinstance(d, list) else [d] * n
        legs = [self.submit(x, params, pi, di) for x, pi, di in zip(prompts, ps, ds,
                                                                     strict=True)]
        self.run(timeout)
        for leg in legs:
            assert_ok(leg)
        return legs

    # -- running -----------------------------------------------------------------------------
    def busy(self, engines=None) -> bool:
        return any(e.has_work() for e in engines or self.engines)

    def step(self, engines=None) -> None:
        """One iteration of every engine with work; a short sleep when all of them only
        wait on transfers (lets the KV threads run)."""
        runnable = False
        for e in engines or self.engines:
            if e.has_work():
                e.step()
                runnable |= e.has_runnable()
        if not runnable:
            time.sleep(0.0005)

    def run(self, timeout: float = 60.0, until=None, engines=None) -> None:
        """Step `engines` (default: all) until they are idle, or until `until()` is true;
        fail after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.busy(engines):
            if until is not None and until():
                return
            if time.monotonic() > deadline:
                what = "condition not met" if until is not None else "engines not idle"
                raise AssertionError(f"{what} after {timeout}s:\n{self.dump()}")
            self.step(engines)
        if until is not None and not until():
            raise AssertionError(f"engines idle but condition not met:\n{self.dump()}")
        for e in engines or self.engines:
            e.loop.drain()

    def dump(self) -> str:
        lines = []
        for name, e in self.named():
            r = e.role
            queues = {k: len(v) for k, v in vars(r).items() if isinstance(v, list)}
            lines.append(f"{name}: requests={sorted(e.requests)} waiting={len(e.sched.waiting)}"
                         f" running={len(e.sched.running)} role_queues={queues} "
                         f"mem={e.memory_stats()} meta_free={r.meta.num_free}/{r.meta.size}")
            for req in e.requests.values():
                lines.append(f"   {req.rid}: state={req.state.value} kv_len={req.kv_len} "
                             f"out={len(req.output_ids)} finish={req.finish_reason} "
                             f"error={req.error}")
        return "\n".join(lines)

    def named(self):
        yield from ((f"prefill{i}", e) for i, e in enumerate(self.prefills))
        yield from ((f"decode{i}", e) for i, e in enumerate(self.decodes))

    # -- checks ------------------------------------------------------------------------------
    def problems(self) -> dict[str, list[str]]:
        out = {}
        for name, e in self.named():
            if p := engine_problems(e):
                out[name] = p
        return out

    def assert_pools_full(self) -> None:
        problems = self.problems()
        assert not problems, f"not back to full: {problems}\n{self.dump()}"

    def reset_caches(self, which: str = "pd") -> None:
        engines = (self.prefills if "p" in which else []) + \
            (self.decodes if "d" in which else [])
        for e in engines:
            if e.kv.cache is not None:
                e.kv.cache.reset()

    def close(self) -> None:
        errors = []
        for e in self.engines:
            try:
                e.close()
            except Exception as exc:  # close the others anyway
                errors.append(exc)
        self.prefills, self.decodes = [], []
        if errors:
            raise errors[0]


def engine_problems(e: Engine) -> list[str]:
    """Everything that keeps `e` from being idle with all pools and slots back to full."""
    out = []
    if e.requests:
        out.append(f"live requests: {sorted(e.requests)}")
    if e.sched.waiting or e.sched.running:
        out.append(f"scheduler: {len(e.sched.waiting)} waiting, {len(e.sched.running)} running")
    if getattr(e.loop, "results", None):
        out.append(f"{len(e.loop.results)} unprocessed results")
    if e.role.has_work():
        out.append("role queues not empty")
    for name, value in vars(e.role).items():
        if isinstance(value, list) and value:
            out.append(f"role.{name} holds {len(value)} requests")
    if not e.pools_full():
        out.append(f"KV pages / request slots not back to full: {e.memory_stats()}")
    meta = e.role.meta
    if meta.num_free != meta.size:
        out.append(f"metadata slots: {meta.num_free} of {meta.size} free")
    if e.kv.cache is not None and e.kv.cache.locked_pages:
        out.append(f"{e.kv.cache.locked_pages} radix pages still locked")
    return out


def assert_ok(leg: Leg2) -> None:
    for side, req in (("prefill", leg.prefill), ("decode", leg.decode)):
        if req is None:
            continue
        assert req.error is None and req.finish_reason in ("length", "stop"), (
            f"{side} leg of {leg.rid} (prompt {len(req.prompt_ids)} tokens) ended with "
            f"{req.finish_reason!r}: {req.error}")
    if leg.prefill is not None:
        assert len(leg.prefill.output_ids) == 1, leg.prefill.output_ids
        if leg.decode is not None:  # the first token came from the prefill's metadata row
            assert leg.decode.output_ids[:1] == leg.prefill.output_ids


def assert_failed(req: Req, what: str) -> None:
    """The leg ended with a clear error (not a normal finish)."""
    assert req is not None
    assert req.finish_reason in ("abort", "error"), (what, req.finish_reason, req.error)
    assert req.error and isinstance(req.error, str), (what, req.error)
