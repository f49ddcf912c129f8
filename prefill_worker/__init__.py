"""The prefill service: `POST /prefill` computes a prompt's uncached blocks, samples the first
token and exports the blocks under a lease (`worker/` holds what both roles share)."""

from __future__ import annotations

from fastapi import FastAPI

from worker.role import RoleParts
from worker.settings import WorkerSettings


def parts() -> RoleParts:
    from prefill_worker.api import prefill_router
    from prefill_worker.prefill import run_prefill

    return RoleParts(routers=(prefill_router,), prefill=run_prefill)


def create_app(settings: WorkerSettings) -> FastAPI:
    from worker.app import create_app as create_worker_app

    return create_worker_app(settings.model_copy(update={"role": "prefill"}), parts())
