"""`create_app(settings)`: the OpenAI-compatible gateway's HTTP wiring. The request path is
router/gateway.py, the response shapes router/responses.py. The router never imports torch."""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.body_limit import BodyLimit
from common.errors import install_error_handlers
from router.front import FrontedAPI
from router.gateway import ROLES, Gateway
from router.openai_format import body_schema, correlation_id, parse_body
from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.responses import complete
from router.settings import RouterSettings


def create_app(settings: RouterSettings) -> FastAPI:
    gw = Gateway.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with gw.running():
            yield

    app = FrontedAPI(title="Tandem router", lifespan=lifespan, max_body_bytes=settings.max_body_bytes)
    install_error_handlers(app)

    async def serve(chat: bool, headers, raw: bytes) -> Response:
        api_key = gw.auth.check(headers.get("authorization"))  # 401 before any 400
        await gw.limiter.admit(api_key)  # 429 before any parsing or tokenizing
        body = parse_body(ChatCompletionRequest if chat else CompletionRequest, raw)
        return await complete(gw, body, chat, correlation_id(headers.get("x-request-id")), api_key)

    # Served by FrontedAPI.serve_directly (router/front.py); declared for the OpenAPI schema. The
    # body is validated by `parse_body` rather than FastAPI's dependency layer: the same pydantic
    # models and the same 400s, for about a third of the per-request cost.
    for path, chat, model in (("/v1/chat/completions", True, ChatCompletionRequest),
                              ("/v1/completions", False, CompletionRequest)):
        app.post(path, openapi_extra=body_schema(model, settings.model))(_endpoint(serve, chat))
        app.serve_directly(path, functools.partial(serve, chat))
    # Every other route: a plain ASGI wrapper (Starlette's BaseHTTPMiddleware costs ~1 ms a call).
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gw.auth.check(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0,
                                            "owned_by": "tandem"}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        live = gw.directory.live()
        ok = any(w.role in ("decode", "colocated") for w in live)
        return JSONResponse({"ready": ok, "workers": {w.worker_id: w.role for w in live},
                             "redis": gw.directory.redis_ok}, 200 if ok else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        for role in ROLES:
            gw.metrics.workers.labels(role).set(len(gw.directory.live(role)))
        gw.metrics.inflight.set(gw.admission.running + gw.admission.queued)
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.directory = gw.directory
    app.state.gateway = gw
    return app


def _endpoint(serve, chat: bool):
    async def endpoint(request: Request) -> Response:
        return await serve(chat, request.headers, await request.body())

    return endpoint
