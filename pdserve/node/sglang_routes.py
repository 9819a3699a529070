"""Worker endpoints SGLang's router calls (docs/architecture.md: Interfaces, "Behind
SGLang's router").

Found by running `sglang-router` 0.3.2 in front of pdserve nodes: at start-up it asks
`GET /health`, `/server_info` and `/model_info` (the model name labels the worker); its
own `/get_model_info` is forwarded to a worker's `/get_model_info`, its `/flush_cache` to
every worker's `POST /flush_cache`. SGLang's older names (`/get_server_info`) and
`/health_generate` answer too.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from pdserve.http.errors import ApiError
from pdserve.node.frontend import Frontend

VERSION = "pdserve-0.1.0"


def sglang_server_info(front: Frontend) -> dict:
    """The /server_info keys SGLang's router and tools read, with pdserve's values."""
    ready = front.client.info
    mode = {"prefill": "prefill", "decode": "decode"}.get(front.cfg.role, "null")
    return {"model_path": front.cfg.engine.model, "served_model_name": front.cfg.model_name,
            "tokenizer_path": front.cfg.engine.model, "disaggregation_mode": mode,
            "host": front.cfg.host, "port": front.cfg.port,  # the bound one, for --port 0
            "disaggregation_bootstrap_port": front.bootstrap_port, "tp_size": 1, "dp_size": 1,
            "page_size": ready.page_size, "max_total_num_tokens": ready.max_total_tokens,
            "version": VERSION}


def add_sglang_routes(app: FastAPI, front: Frontend, node_info: Callable[[Frontend], dict]
                      ) -> None:
    @app.get("/get_server_info")
    async def get_server_info():
        return node_info(front)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": front.cfg.engine.model, "tokenizer_path": front.cfg.engine.model,
                "served_model_name": front.cfg.model_name, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False}

    @app.get("/health_generate")
    async def health_generate():
        """Colocated: one greedy token through the engine. A PD node cannot generate alone
        (a prefill needs a decode partner and the reverse), so there it is /health."""
        if not front.client.alive:
            raise ApiError(503, "the scheduler process is not running")
        if front.cfg.role == "colocated":
            async for _ in front.run([0], {"max_new_tokens": 1, "temperature": 0.0}):
                pass
        return {"status": "ok"}

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache():
        if not front.client.alive:
            raise ApiError(503, "the scheduler process is not running")
        await front.client.flush_cache()
        return {"status": "ok", "message": "Cache flushed: prefix-cache pages no running "
                                           "request holds are freed."}
