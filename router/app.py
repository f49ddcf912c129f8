"""`create_app(settings)`: the OpenAI-compatible gateway's HTTP wiring. The request path is
router/gateway.py, its run (sessions, Redis, background refreshes) router/lifespan.py, the response
shapes router/responses.py. The router never imports torch."""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.body_limit import BodyLimit
from common.errors import APIError, error_response, install_error_handlers
from router.clients import client_id
from router.front import FrontedAPI
from router.gateway import Gateway
from router.lifespan import running
from router.metrics import NO_MODEL
from router.openai_format import body_schema, correlation_id
from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.planner_loop import PlannerLoop, planner_config, planning
from router.policy import ROLES
from router.responses import complete
from router.settings import RouterSettings


def create_app(settings: RouterSettings) -> FastAPI:
    gw = Gateway.from_settings(settings)
    planner = PlannerLoop(planner_config(settings), settings.planner_interval_s, gw.registry,
                          gw.metrics, gw.directory,
                          lambda: served_models(gw)) if settings.planner_interval_s else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with running(gw), planning(planner, gw.directory.errors):
            yield

    # Errors answered before a model is known (413, a client gone) count under no model.
    app = FrontedAPI(title="Tandem router", lifespan=lifespan,
                     max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s,
                     on_error=lambda status: gw.metrics.count(status, NO_MODEL))
    install_error_handlers(app)

    async def serve(chat: bool, headers, raw: bytes, peer: str | None) -> Response:
        body = None
        try:
            api_key = gw.auth.check(headers.get("authorization"))  # 401 before any 400
            client = client_id(api_key, peer)
            # One client's requests are worked on a few at a time (router/clients.py): a client
            # looping cheap refusals cannot take the event loop from the others.
            async with gw.clients.enter(client):
                await gw.limiter.admit(api_key)  # 429 before any parsing or tokenizing
                body = await gw.prompts.parse(ChatCompletionRequest if chat else CompletionRequest,
                                              raw)
                return await complete(gw, body, chat, correlation_id(headers.get("x-request-id")),
                                      api_key, client, len(raw))
        except Exception as e:  # noqa: BLE001 - counted here, answered by FrontedAPI
            response = error_response(e)
            gw.metrics.count(response.status_code, body.model if body is not None else NO_MODEL)
            return response

    # Served by FrontedAPI.serve_directly (router/front.py); declared for the OpenAPI schema. The
    # body is validated by `parse_body` rather than FastAPI's dependency layer: the same pydantic
    # models and the same 400s, for about a third of the per-request cost.
    for path, chat, model in (("/v1/chat/completions", True, ChatCompletionRequest),
                              ("/v1/completions", False, CompletionRequest)):
        app.post(path, openapi_extra=body_schema(model, settings.model))(_endpoint(serve, chat))
        app.serve_directly(path, functools.partial(serve, chat))
    # Every other route: a plain ASGI wrapper (Starlette's BaseHTTPMiddleware costs ~1 ms a call).
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    add_info_routes(app, gw)

    @app.get("/metrics")
    async def prom() -> Response:
        for role in ROLES:
            gw.metrics.workers.labels(role).set(len(gw.directory.live(role)))
        gw.metrics.inflight.set(gw.admission.running + gw.admission.queued)
        gw.metrics.models.set(len(served_models(gw)))
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.directory = gw.directory
    app.state.gateway = gw
    app.state.planner = planner
    return app


def add_info_routes(app: FastAPI, gw: Gateway) -> None:
    """`/v1/models`, `/v1/models/{id}`, `/health`, `/ready`."""

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gw.auth.check(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card(gw, name) for name in served_models(gw)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        gw.auth.check(request.headers.get("authorization"))
        if model_id not in served_models(gw):
            raise APIError(404, f"model {model_id!r} does not exist", "model_not_found", "model")
        return model_card(gw, model_id)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        live = [w for w in gw.directory.live() if w.accepted]  # refused workers do not count
        roles = {w.role for w in live}
        # What /ready waits for: a worker that decodes, and each of --ready-roles.
        missing = [r for r in gw.settings.ready_roles if r not in roles]
        if not roles & {"decode", "colocated"}:
            missing.append("decode")
        ok = not gw.draining and not missing
        return JSONResponse({"ready": ok, "missing": sorted(set(missing)),
                             "workers": {w.worker_id: w.role for w in live},
                             "models": served_models(gw), "redis": gw.directory.redis_ok,
                             "index": gw.index.stats() if gw.index is not None else None,
                             "draining": gw.draining}, 200 if ok else 503,
                            headers={"X-Tandem-Instance": gw.settings.instance_nonce}
                            if gw.settings.instance_nonce else None)


def served_models(gw: Gateway) -> list[str]:
    """Names with a live worker that can answer (decode or colocated)."""
    return gw.catalog.served(w for w in gw.directory.workers.values()
                             if w.role in ("decode", "colocated"))


def model_card(gw: Gateway, name: str) -> dict:
    model = gw.catalog.get(name)
    return {"id": name, "object": "model", "created": model.created, "owned_by": "tandem",
            "root": name, "parent": None,  # not the folder: its path is the operator's business
            "max_model_len": gw.directory.max_model_len(gw.settings.max_model_len_default, name)}


def _endpoint(serve, chat: bool):
    async def endpoint(request: Request) -> Response:
        return await serve(chat, request.headers, await request.body())

    return endpoint
