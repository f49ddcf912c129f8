"""`POST /prefill` (docs/contract.md "Worker <-> router API")."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from common.auth import require_internal_token
from common.protocol import PrefillRequest, PrefillResponse
from prefill_worker.prefill import run_prefill
from worker.abortable import run_abortable
from worker.errors import APIError
from worker.internal_api import sampling_params
from worker.state import WorkerState


def prefill_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        dependencies=[Depends(require_internal_token(state.settings.internal_token))])

    @router.post("/prefill", response_model=PrefillResponse)
    async def prefill(req: PrefillRequest, request: Request) -> PrefillResponse:
        params = sampling_params(req.sampling)
        try:
            # Stopped when the router gives the leg up (it disconnects, or calls /abort).
            resp = await run_abortable(state, request, req.request_id, run_prefill(
                state, req.request_id, req.prompt_token_ids, params, req.lease_seconds,
                tenant=req.tenant(), prefix_kv=req.prefix_kv_params))
        except APIError as e:
            state.metrics.requests.labels("prefill", str(e.status)).inc()
            raise
        state.metrics.requests.labels("prefill", "200").inc()
        return resp

    return router
