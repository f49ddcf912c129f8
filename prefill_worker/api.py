"""`POST /prefill` (docs/contract.md "Worker <-> router API")."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from common.auth import require_internal_token
from common.protocol import PrefillRequest, PrefillResponse
from prefill_worker.prefill import run_prefill
from worker.errors import APIError
from worker.internal_api import sampling_params
from worker.state import WorkerState


def prefill_router(state: WorkerState) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_internal_token(state.settings.internal_token))])

    @router.post("/prefill", response_model=PrefillResponse)
    async def prefill(req: PrefillRequest) -> PrefillResponse:
        params = sampling_params(req.sampling)
        try:
            resp = await run_prefill(state, req.request_id, req.prompt_token_ids, params,
                                     req.lease_seconds, client=req.client_tag)
        except APIError as e:
            state.metrics.requests.labels("prefill", str(e.status)).inc()
            raise
        state.metrics.requests.labels("prefill", "200").inc()
        return resp

    return router
