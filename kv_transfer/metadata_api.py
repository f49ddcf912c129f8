"""`GET /kv/metadata`: the transport handshake endpoint every worker mounts."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from common.auth import require_internal_token
from kv_transfer.connector import KVConnector


def metadata_router(connector: KVConnector, token: str | None) -> APIRouter:
    router = APIRouter()

    @router.get("/kv/metadata", dependencies=[Depends(require_internal_token(token))])
    async def kv_metadata() -> dict:
        return connector.metadata().model_dump()

    return router
