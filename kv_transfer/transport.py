"""The `Transport` plug-in point: how block bytes move between two registered KV caches.

A transport is built over one engine's KV cache. The receiving side calls `pull`, which copies
the peer's `remote_block_ids` into the local `local_block_ids` and then tells the peer it is done;
the sending side learns of those completions from `completed()`. The implementations are named in
kv_transfer/transports.py (name -> class); all share the constructor signature below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from common.bounds import EngineId
from kv_transfer.layout import KVLayout


class TransferError(RuntimeError):
    """A pull failed; the receiving side falls back to computing the KV itself."""


class TransferTimeout(TransferError):
    pass


class PeerMetadata(BaseModel):
    """What a worker serves at `GET /kv/metadata`: enough for a peer to pull from it."""

    model_config = ConfigDict(extra="forbid")

    engine_id: EngineId
    transport: Literal["nixl", "tcp"]
    layout: KVLayout
    params: dict[str, Any]  # each transport validates its own (e.g. nixl_transport.NixlParams)


@dataclass
class TransportConfig:
    engine_id: str
    token: str | None = None  # internal bearer token; required from peers when set
    listen_host: str = "127.0.0.1"
    advertise_host: str | None = None  # the address peers use (defaults to listen_host)
    port: int = 0  # tcp transport's data port (0 = pick a free one)
    pull_timeout_s: float = 10.0
    poll_interval_s: float = 0.0005
    chunk_bytes: int = 16 << 20
    fp8: bool = False  # tcp: send blocks as e4m3 + per-run scales (lossy, about half the bytes)
    ucx_proto_log: str | None = None  # a UCX_LOG_FILE written with UCX_PROTO_INFO=y, if any
    handshake_timeout_s: float = 5.0  # tcp: a peer's whole request header must arrive within it
    # Staged pulls (kv_transfer/pull_plan.py): "auto" by the cost model, "always", "never".
    staging: str = "auto"
    staging_bytes: int = 512 << 20  # nixl: the staging region (whole blocks; 0 = none)


@dataclass
class PullStats:
    num_blocks: int
    num_bytes: int
    seconds: float
    num_descriptors: int = 0
    transport_label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Transport(Protocol):
    name: str

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout,
                 config: TransportConfig) -> None: ...

    async def start(self) -> None:
        """Register memory / open listeners."""

    async def close(self) -> None: ...

    def metadata(self) -> PeerMetadata:
        """This side's metadata document (served at GET /kv/metadata)."""

    def set_export_check(self, check) -> None:
        """Sender side: `check(request_id, block_ids)` raises if a peer asks for blocks the
        request does not hold under a lease (transports that see the request enforce it)."""

    async def pull(
        self,
        peer: PeerMetadata,
        request_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        staged_slots: list[int] | None = None,
    ) -> PullStats:
        """Copy blocks from the peer, then notify it with `request_id`. Raises TransferError.
        `staged_slots`: where the peer staged those blocks, for transports that stage (`stage`
        / `unstage` on the sending side, kv_transfer/staging.py); others ignore it."""

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        """Tell the peer it may free `request_id`'s blocks without pulling any (all local)."""

    def completed(self) -> list[str]:
        """Sender side: request ids whose receivers have notified since the last call."""

    @property
    def label(self) -> str:
        """Which wire it runs on (e.g. 'ucx:cma', 'ucx:tcp', 'tcp'), for logs and metrics."""
