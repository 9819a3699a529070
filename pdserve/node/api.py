"""FastAPI routes of a node (docs/architecture.md: Interfaces): /generate, OpenAI completions and
chat, models,
health, metrics. Errors are OpenAI-shaped: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

import time
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve.http.choices import last_events, merge, start_all
from pdserve.http.errors import ApiError, error_body, error_response, install_error_handlers
from pdserve.http.event_stream import EventStream
from pdserve.http.logprob_format import TokenText, sglang_meta
from pdserve.http.openai_format import final_response, openai_stream
from pdserve.http.openai_plan import encode_prompts, make_plan
from pdserve.http.protocol import (
    ChatBody,
    CompletionBody,
    GenerateBody,
    chat_prompt_ids,
    fit_max_tokens,
)
from pdserve.http.sse import sse
from pdserve.http.tokenize_routes import add_tokenize_routes
from pdserve.node.frontend import Frontend, TraceStart
from pdserve.node.sglang_routes import add_sglang_routes, sglang_server_info


def node_info(front: Frontend) -> dict:
    """/server_info: pdserve's fields, plus the SGLang names its router reads
    (`sglang_routes.py`)."""
    s, ready = front.client.stats, front.client.info
    return {"model": front.cfg.model_name, "context_length": front.context_length,
            "engine": ready.engine_info, "stats": vars(s) if s else None,
            "open_requests": len(front.client.handles), **sglang_server_info(front)}


def build_app(front: Frontend, lifespan=None) -> FastAPI:
    app = FastAPI(title="pdserve node", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    model = front.cfg.model_name

    # /livez: restart me only when the scheduler process is gone. /readyz: send me work
    # (not while draining). /health: as /readyz, because SGLang's router polls /health to
    # decide where to send work and would keep sending to a draining node otherwise.
    @app.get("/livez")
    async def livez():
        if not front.client.alive:
            return error_response(503, "the scheduler process is not running")
        return {"status": "ok"}

    @app.get("/health")
    @app.get("/readyz")
    async def readyz():
        if not front.client.alive:
            return error_response(503, "the scheduler process is not running")
        if front.draining:
            return error_response(503, "this node is draining (shutting down)", "draining")
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info():
        return node_info(front)

    @app.get("/metrics")
    async def metrics():
        return Response(front.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": front.context_length}]}

    token_text = TokenText(front.tokenizer)

    async def tokenizer():
        return front.tokenizer

    add_tokenize_routes(app, tokenizer, lambda: model, lambda: front.context_length,
                        lambda: front.client.info.vocab_size)

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        received = time.time_ns()
        ids = front.encode(body.validate_input())
        sp = body.sampling_params.model_dump()
        explicit = "max_new_tokens" in body.sampling_params.model_fields_set
        sp["max_new_tokens"] = fit_max_tokens(
            len(ids), sp["max_new_tokens"] if explicit else None, sp["max_new_tokens"],
            front.context_length, front.cfg.truncate_max_tokens)
        sp |= body.logprob_params(len(ids))
        leg = await front.resolve_leg(body.leg_fields())
        start = body.logprob_start_len if body.return_logprob else None
        # The client is watched in both modes: a stream's first event may be long in coming
        # (a decode leg waiting for its KV), and a leg its router gave up on must end here.
        run = front.run(ids, sp, body.rid, leg, request.is_disconnected,
                        _trace(request, received, leg is not None))
        if body.stream:
            return EventStream(_generate_sse(await _started(run), ids, start))
        last = None
        async for ev in run:
            last = ev
        return _generate_obj(last, ids, start) if last else \
            error_response(499, "client disconnected")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        received = time.time_ns()
        body.check_common(model, front.cfg.max_n)
        prompts = encode_prompts(body.prompts(), front.encode)
        return await _openai(body, prompts, request, "text_completion", received)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        received = time.time_ns()
        body.check_common(model, front.cfg.max_n)
        msgs = [x.for_template() for x in body.messages]
        ids = chat_prompt_ids(front.tokenizer, msgs, tools=body.template_tools())
        front.check_ids(ids)
        return await _openai(body, [ids], request, "chat.completion", received)

    async def _openai(body, prompts: list[list[int]], request: Request, kind: str,
                      received: int):
        default = 16 if kind == "text_completion" else front.default_max_tokens(prompts[0])
        plan = make_plan(body, prompts, kind, model, default, front.context_length,
                         front.cfg.truncate_max_tokens, token_text, front.cfg.tool_call_parser)
        # A PD leg sent by SGLang's router: its bootstrap fields ride on OpenAI bodies too.
        # One leg is one request (one bootstrap room): several choices cannot share it.
        leg = await front.resolve_leg(body.leg_fields())
        if leg is not None and len(plan.choices) > 1:
            raise ApiError(400, "several prompts or n > 1 are not supported on a "
                                "prefill/decode leg: the router sends each prompt and "
                                "choice as its own request")
        runs = [front.run(c.ids, c.sampling, leg=leg, disconnected=request.is_disconnected,
                          trace=_trace(request, received, leg is not None))
                for c in plan.choices]
        if body.stream or len(runs) > 1:
            runs = await start_all(runs, _started, plan.leaders)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(openai_stream(merge(runs), plan.shape, usage))
        lasts = await last_events(runs)
        if any(ev is None for ev in lasts):
            return error_response(499, "client disconnected")
        return final_response(plan.shape, lasts)

    def _trace(request: Request, received: int, leg: bool) -> TraceStart | None:
        """The request's trace context when tracing is on (a leg was resolved just now)."""
        if front.tracer is None:
            return None
        return TraceStart(request.headers, received, time.time_ns() if leg else 0)

    add_sglang_routes(app, front, node_info)
    return app


async def _started(events):
    """Pull the first event before answering 200, so admission errors (400/429/503) still
    become the HTTP status of a streaming request."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:  # the client left before the first event (nobody reads this)
        raise ApiError(499, "client disconnected") from None

    async def chain():
        yield first
        try:
            async for ev in events:
                yield ev
        except ApiError as exc:  # after the 200 header: report in-band, then end the stream
            yield exc
        finally:
            await events.aclose()  # closed early (n > 1 choices): abort the request now

    return chain()


async def _generate_sse(events, ids: list[int], start: int | None):
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, ApiError):
                yield sse(error_body(ev))
                break
            yield sse(_generate_obj(ev, ids, start))
    yield "data: [DONE]\n\n"


def _generate_obj(ev, ids: list[int], start: int | None) -> dict:
    """SGLang's /generate body; `start` is logprob_start_len when logprobs were asked."""
    meta = {"id": ev.rid, "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": len(ev.output_ids), "cached_tokens": ev.cached_tokens,
            "finish_reason": ev.finish_reason}
    if start is not None:
        meta |= sglang_meta(ev.output_ids, ev.output_logprobs, ids, ev.prompt_logprobs, start)
    return {"text": ev.text, "output_ids": ev.output_ids, "meta_info": meta}
