"""The part of Tandem's internal worker API that every role serves: `POST /abort/{request_id}`.
The role endpoints live with their roles (`prefill_worker/api.py`, `decode_worker/api.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from common.auth import require_internal_token
from engine.sampling_params import SamplingParams
from worker.errors import APIError
from worker.state import WorkerState


def sampling_params(options) -> SamplingParams:
    try:
        return SamplingParams.from_options(options)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_sampling_params") from e


def abort_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        dependencies=[Depends(require_internal_token(state.settings.internal_token))])

    @router.post("/abort/{request_id}")
    async def abort(request_id: str) -> dict:
        """Drop the request wherever it is: a prefill still computing (its task is cancelled:
        worker/abortable.py), its blocks exported under a lease (released now), a stream."""
        task = state.abortable.get(request_id)
        if task is not None:
            task.cancel()
        cancelled = state.connector.cancel_export(request_id) if state.connector else False
        aborted = await state.engine.abort(request_id)
        return {"request_id": request_id, "aborted": aborted or cancelled or task is not None}

    return router
