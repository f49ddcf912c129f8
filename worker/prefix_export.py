"""`POST /kv/prefix-export` (docs/contract.md "Peer prefix pulls"): the holder's side of a peer
prefix pull. The router names a prompt's leading block hashes and the worker that will compute
the prompt; this worker pins the longest prefix of them it still holds (any tier: a host or disk
block is reloaded first), leases those blocks to the requester exactly as a prefill worker leases
a prompt's (kv_transfer/lease.py: freed on the requester's notification or at the deadline) and
answers how many it leased with a prefix handle signed for that requester alone. A block
evicted since the router planned simply shortens the answer."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from common.auth import require_internal_token
from common.prefix_export import PrefixExportRequest, PrefixExportResponse
from common.protocol import KVTransferParams
from kv_transfer import handle
from worker.errors import APIError
from worker.state import WorkerState


async def export_prefix(state: WorkerState, req: PrefixExportRequest) -> PrefixExportResponse:
    s, connector = state.settings, state.connector
    state.admit_export()  # a draining worker pins nothing new, but what it hands off
    if connector is None:
        raise APIError(503, "this worker has no KV transport", "no_kv_transport")
    if req.lease_seconds is not None and req.lease_seconds > s.max_lease_seconds:
        raise APIError(400, f"lease_seconds must be at most {s.max_lease_seconds}",
                       "invalid_lease", "lease_seconds")
    if req.request_id in connector.leases:
        raise APIError(409, f"{req.request_id!r} already holds a lease here",
                       "duplicate_request_id", "request_id")
    try:
        block_ids = await state.engine.call("pin_prefix", req.request_id, req.block_hashes)
    except ValueError as e:  # the id already pins blocks
        raise APIError(409, str(e), "duplicate_request_id", "request_id") from e
    if not block_ids:
        state.metrics.prefix_exports.labels("none_held").inc()
        return PrefixExportResponse(num_blocks=0)
    try:
        # No await from here to the answer: a cancellation cannot land between lease and reply.
        exported = connector.export(req.request_id, block_ids, req.lease_seconds)
    except BaseException:
        state.engine.post("release", req.request_id)
        raise
    fields = dict(remote_host=s.public_host, remote_port=s.port, requester=req.requester,
                  block_hashes=list(req.block_hashes[:len(block_ids)]),
                  expires_at=exported["lease_expires_at"], **exported)
    state.metrics.prefix_exports.labels("leased").inc()
    return PrefixExportResponse(
        num_blocks=len(block_ids),
        kv_transfer_params=KVTransferParams(**handle.sign_prefix(fields, s.internal_token)))


def prefix_export_router(state: WorkerState) -> APIRouter:
    router = APIRouter(
        dependencies=[Depends(require_internal_token(state.settings.internal_token))])

    @router.post("/kv/prefix-export", response_model=PrefixExportResponse)
    async def prefix_export(req: PrefixExportRequest) -> PrefixExportResponse:
        return await export_prefix(state, req)

    return router
