"""Wire models of a peer prefix export (docs/contract.md "Peer prefix pulls"): the router asks a
worker that holds a prompt's leading blocks to pin them for the worker that will compute the
prompt, which pulls them instead of recomputing them (issue 42)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from common.bounds import BlockHashes, EngineId, LeaseSeconds, RequestId
from common.protocol import KVTransferParams

# The most leading blocks one export may name: 1 << 16 blocks of 16 tokens is a 1M-token prompt.
MAX_EXPORT_BLOCKS = 1 << 16


class PrefixExportRequest(BaseModel):
    """`POST /kv/prefix-export`: pin the cached blocks of the longest held prefix of
    `block_hashes` under a lease named `request_id` for engine `requester` to pull."""

    model_config = ConfigDict(extra="forbid")

    request_id: RequestId
    block_hashes: BlockHashes = Field(min_length=1, max_length=MAX_EXPORT_BLOCKS)
    requester: EngineId
    lease_seconds: LeaseSeconds | None = None  # each worker caps it at its --max-lease-seconds


class PrefixExportResponse(BaseModel):
    """How many leading blocks the holder leased (0: none held any more, no lease), and the
    signed prefix handle (kv_transfer/handle.py `sign_prefix`) the requester pulls them with."""

    num_blocks: int = Field(ge=0, le=MAX_EXPORT_BLOCKS)
    kv_transfer_params: KVTransferParams | None = None
