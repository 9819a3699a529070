"""FastAPI routes of the router: the node's HTTP API (docs/architecture.md: Interfaces) in
front of the cluster, plus `GET /nodes` (the router's view of every node). Request bodies,
OpenAI chunk shapes and error shapes come from the same layer the node uses
(`pdserve.http`), so both speak one dialect.

A request answers 200 only once the decode leg produced its first event: failures before
that (bad input, no node, queue full, a leg failing) become the HTTP status; later ones
are reported in-band and end the stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.http.choices import merge
from pdserve.http.errors import ApiError, error_body, error_response, install_error_handlers
from pdserve.http.event_stream import EventStream
from pdserve.http.logprob_format import TokenText
from pdserve.http.openai_format import final_response, openai_stream
from pdserve.http.openai_plan import encode_prompts, make_plan, sglang_fields
from pdserve.http.protocol import (
    ChatBody,
    CompletionBody,
    GenerateBody,
    fit_max_tokens,
)
from pdserve.http.sse import sse
from pdserve.http.tokenize_routes import add_tokenize_routes
from pdserve.router.flow import Flow
from pdserve.router.gateway import Gateway
from pdserve.router.tokenizer import RouterTokenizer

DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    pass


class FlowResponse(EventStream):
    """A streaming response that closes its flows however the response ends, including a
    client that left before the first byte (the body generator never runs then). The
    close is synchronous: it stops both legs before anything else can be awaited."""

    def __init__(self, flows: Flow | list[Flow], content) -> None:
        flows = flows if isinstance(flows, list) else [flows]
        super().__init__(content, headers=flows[0].headers)
        self.flows = flows

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for flow in self.flows:
                flow.close()


async def until_disconnected(request: Request, awaitable):
    """Await while watching the client; if it leaves, cancel and raise ClientGone (the
    cancellation stops both legs, and the nodes abort the request)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        task.cancel()


async def collect(flow: Flow):
    """The final event of a non-streaming request (raises its in-band error)."""
    last = None
    async for ev in flow.events():
        if isinstance(ev, ApiError):
            raise ev
        last = ev
    return last


def _loaded(gw: Gateway) -> RouterTokenizer:
    """The tokenizer the tokenize routes awaited before they ask for its sizes."""
    tok = gw.loaded_tokenizer
    if tok is None:
        raise ApiError(503, "the tokenizer is not loaded yet", "no_tokenizer")
    return tok


def build_app(gw: Gateway, lifespan=None) -> FastAPI:
    app = FastAPI(title="pdserve router", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone):
        return error_response(499, "client disconnected")

    # /livez: the process serves HTTP (a probe must not restart the router, dropping every
    # open stream, because a node tier is down). /readyz and /health: a usable pair exists.
    @app.get("/livez")
    async def livez():
        return {"status": "ok"}

    @app.get("/health")
    @app.get("/readyz")
    async def health():
        ok, info = gw.health()
        if ok:
            return {"status": "ok", **info}
        return JSONResponse({**error_body(ApiError(503, f"not ready: {info['reason']}")),
                             "detail": info}, status_code=503)

    @app.get("/nodes")
    async def nodes():
        w = gw.watcher
        return {"registry": {"url": gw.cfg.registry, "connected": w.connected,
                             "last_error": w.last_error},
                "nodes": [n.view() for n in gw.table.nodes.values()]}

    @app.get("/metrics")
    async def metrics():
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        if not gw.model_name:
            return {"object": "list", "data": []}
        tok = gw.loaded_tokenizer
        return {"object": "list", "data": [{
            "id": gw.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": tok.context_length if tok else None}]}

    async def tokenizer():
        return (await gw.tokenizer()).tok

    add_tokenize_routes(app, tokenizer, lambda: gw.model_name,
                        lambda: _loaded(gw).context_length, lambda: _loaded(gw).vocab_size)
    texts: dict[int, TokenText] = {}

    def token_text(tok) -> TokenText:
        if id(tok) not in texts:
            texts.clear()
            texts[id(tok)] = TokenText(tok.tok)
        return texts[id(tok)]

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        received = time.time_ns()
        prompt = body.validate_input()
        if body.leg_fields():
            raise ApiError(400, "bootstrap_room, prefill_node_id, bootstrap_host, "
                                "bootstrap_port and decode_tp_size are set by the router")
        tok = await gw.tokenizer()
        ids = tok.encode(prompt)
        sp = body.sampling_params.model_dump()
        explicit = "max_new_tokens" in body.sampling_params.model_fields_set
        sp["max_new_tokens"] = fit_max_tokens(
            len(ids), sp["max_new_tokens"] if explicit else None, sp["max_new_tokens"],
            tok.context_length, gw.cfg.truncate_max_tokens)
        extra = {k: getattr(body, k) for k in ("return_logprob", "top_logprobs_num",
                                                "logprob_start_len")} \
            if body.return_logprob else None
        flow = gw.flow(body.rid or uuid.uuid4().hex, ids, sp, extra, (request.headers, received))
        await until_disconnected(request, flow.start())
        if body.stream:
            return FlowResponse(flow, _generate_sse(flow))
        try:
            last = await until_disconnected(request, collect(flow))
        finally:
            flow.close()
        return JSONResponse(last.generate_obj(), headers=flow.headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        received = time.time_ns()
        tok = await gw.tokenizer()
        body.check_common(gw.model_name, gw.cfg.max_n)
        prompts = encode_prompts(body.prompts(), tok.encode)
        return await _openai(body, prompts, request, "text_completion", 16, tok, received)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        received = time.time_ns()
        tok = await gw.tokenizer()
        body.check_common(gw.model_name, gw.cfg.max_n)
        ids = tok.chat([m.for_template() for m in body.messages], body.template_tools())
        return await _openai(body, [ids], request, "chat.completion",
                             tok.default_max_tokens(ids), tok, received)

    async def _openai(body, prompts: list[list[int]], request: Request, kind: str,
                      default_max: int, tok, received: int):
        plan = make_plan(body, prompts, kind, gw.model_name, default_max, tok.context_length,
                         gw.cfg.truncate_max_tokens, token_text(tok), gw.cfg.tool_call_parser)
        rid = uuid.uuid4().hex
        flows = [gw.flow(rid if i == 0 else f"{rid}-{i}", c.ids, *sglang_fields(c.sampling),
                         trace=(request.headers, received))
                 for i, c in enumerate(plan.choices)]
        leaders = set(plan.leaders)
        tasks: list[asyncio.Future] = []
        try:
            # Each prompt's first choice first: once it has a token its prompt KV sits in
            # the prefill node's prefix cache, so its other choices (started next) reuse it.
            for wave in (plan.leaders, [i for i in range(len(flows)) if i not in leaders]):
                tasks = [asyncio.ensure_future(flows[i].start()) for i in wave]
                if tasks:
                    await until_disconnected(request, asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # a start still running must not open legs after the close
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for flow in flows:
                flow.close()
            raise
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return FlowResponse(flows, openai_stream(merge([f.events() for f in flows]),
                                                     plan.shape, usage))
        try:
            lasts = await until_disconnected(
                request, asyncio.gather(*(collect(f) for f in flows)))
        finally:
            for flow in flows:
                flow.close()
        return JSONResponse(final_response(plan.shape, lasts), headers=flows[0].headers)

    return app


async def _generate_sse(flow: Flow):
    async for ev in flow.events():
        if isinstance(ev, ApiError):
            yield sse(error_body(ev))
            break
        yield sse(ev.generate_obj())
    yield "data: [DONE]\n\n"
