"""`create_app(settings, parts)`: the app every worker role shares (health, readiness,
metrics, the KV metadata endpoint, `/abort`, the OpenAI endpoints), with the role's own parts
mounted (`prefill_worker.create_app`, `decode_worker.create_app`)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.auth import bearer_matches, require_internal_token
from common.body_limit import BodyLimit
from kv_transfer.metadata_api import metadata_router
from worker.errors import install_error_handlers
from worker.internal_api import abort_router
from worker.metrics import WorkerMetrics
from worker.prefix_export import prefix_export_router
from worker.role import RoleParts
from worker.settings import WorkerSettings
from worker.state import WorkerState

log = logging.getLogger(__name__)


class InsecureConfig(ValueError):
    """The worker would listen beyond loopback with its internal API open."""


def create_app(settings: WorkerSettings, parts: RoleParts) -> FastAPI:
    problem = settings.security_problem()
    if problem:
        raise InsecureConfig(problem)
    if not settings.internal_token:
        log.warning("no internal token: the internal API is open to every local process and KV "
                    "handles are unsigned (development only; tandem up generates a token)")
    registry = CollectorRegistry()
    state = WorkerState(settings, registry,
                        WorkerMetrics(registry, settings.role, settings.served_names[0]), parts)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        if state.connector is not None:
            app.include_router(metadata_router(state.connector, settings.internal_token))
            app.include_router(prefix_export_router(state))
        for make_router in (*parts.routers, abort_router):
            app.include_router(make_router(state))
        from worker.openai_api import openai_router

        app.include_router(openai_router(state))
        if settings.fault_injection:
            app.include_router(fault_router(state))
        log.info("%s worker %s ready on %s (model %s, %d KV blocks)", settings.role,
                 settings.resolved_worker_id, settings.url, state.core.model_id,
                 state.core.num_blocks)
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title=f"Tandem {settings.role} worker", lifespan=lifespan)
    app.state.worker = state
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    add_status_routes(app, settings, state, registry)
    return app


def add_status_routes(app: FastAPI, settings: WorkerSettings, state: WorkerState,
                      registry: CollectorRegistry) -> None:
    """`/health`, `/ready` (the model fields only for holders of the internal token), `/metrics`."""

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None or not state.engine.alive:
            return JSONResponse({"status": "dead"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        ok = state.ready and state.engine is not None and state.engine.alive
        token = settings.internal_token
        if token and not bearer_matches(request.headers.get("authorization"), token):
            # A stranger learns ready or not; the model, its digest, hash seed and tokenizer
            # path are for holders of the internal token (routers).
            return JSONResponse({"ready": ok}, 200 if ok else 503)
        body = {"ready": ok, "role": settings.role, "worker_id": settings.resolved_worker_id,
                "redis": state.publisher.connected if state.publisher else None,
                "draining": state.draining}
        if state.engine is not None:
            body.update(state.model_info())  # what a router that lists this worker learns
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.engine is not None:
            state.metrics.sample_engine(state.engine.stats())
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def fault_router(state: WorkerState):
    """Test builds only (`--enable-fault-injection`): make the engine thread fail, as a bug in a
    model step would, to exercise the dead-worker path end to end."""
    from fastapi import APIRouter, Depends

    router = APIRouter(
        dependencies=[Depends(require_internal_token(state.settings.internal_token))],
        include_in_schema=False)

    @router.post("/debug/engine-fault")
    async def engine_fault() -> dict:
        state.engine.inject_fault()
        return {"injected": True}

    return router
