"""The decode service: `POST /generate` pulls the blocks it lacks from a prefill worker (or
prefills locally), joins the continuous batch and streams tokens (`worker/` holds what both
roles share). A colocated worker is both roles in one process."""

from __future__ import annotations

from fastapi import FastAPI

from worker.role import RoleParts
from worker.settings import WorkerSettings


def parts() -> RoleParts:
    from decode_worker.api import generate_router
    from decode_worker.kv_import import BlockImporter

    return RoleParts(routers=(generate_router,), importer=BlockImporter())


def create_app(settings: WorkerSettings, colocated: bool = False) -> FastAPI:
    from worker.app import create_app as create_worker_app

    role = "colocated" if colocated else "decode"
    if colocated:
        import prefill_worker

        return create_worker_app(settings.model_copy(update={"role": role}),
                                 prefill_worker.parts() + parts())
    return create_worker_app(settings.model_copy(update={"role": role}), parts())
