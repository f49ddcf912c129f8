"""`KVConnector`: one worker's end of KV transfer.

Sending side (prefill): `export` pins a request's blocks under a lease and returns the fields of
`kv_transfer_params`; a background task releases leases on the receiver's notification or at
the deadline. Receiving side (decode): `peer` fetches and caches a peer's metadata (checking the
layout), `fetch` bounds-checks block ids and pulls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
import torch

from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.metrics import TransferMetrics
from kv_transfer.transport import (
    PeerMetadata,
    PullStats,
    TransferError,
    TransferTimeout,
    TransportConfig,
    get_transport_class,
)

log = logging.getLogger(__name__)


class KVConnector:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: TransportConfig,
        transport: str,
        release: Callable[[str], None],
        lease_seconds: float = 30.0,
        metrics: TransferMetrics | None = None,
        http: httpx.AsyncClient | None = None,
        watch_interval_s: float = 0.001,
        idle_interval_s: float = 0.05,
    ) -> None:
        self.layout = layout
        self.config = config
        self.transport = get_transport_class(transport)(kv_cache, layout, config)
        self.leases = LeaseTable(self._on_release, lease_seconds)
        self.metrics = metrics
        self._release = release
        self._http = http
        self._own_http = http is None
        self._peers: dict[str, PeerMetadata] = {}
        self._watch_interval_s = watch_interval_s
        self._idle_interval_s = idle_interval_s
        self._watcher: asyncio.Task | None = None
        self._exported = asyncio.Event()  # wakes the idle watcher: a pull may start at once

    async def start(self) -> None:
        await self.transport.start()
        self.transport.set_export_check(self._check_export)
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=10.0)
        self._watcher = asyncio.create_task(self._watch(), name="kv-lease-watcher")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        await self.transport.close()
        if self._own_http and self._http is not None:
            await self._http.aclose()

    def metadata(self) -> PeerMetadata:
        return self.transport.metadata()

    # ---- sending side -------------------------------------------------------------------------

    def export(self, request_id: str, block_ids: list[int], lease_seconds: float | None = None) -> dict:
        """Pin `block_ids` for a receiver; returns the transfer fields of kv_transfer_params."""
        self.layout.check_block_ids(block_ids, "exported")
        expires_at = self.leases.grant(request_id, block_ids, lease_seconds)
        self._exported.set()
        if self.metrics:
            self.metrics.leases.labels("granted").inc()
            self.metrics.leased_blocks.set(self.leases.num_leased_blocks)
        return {
            "remote_engine_id": self.config.engine_id,
            "remote_block_ids": list(block_ids),
            "remote_request_id": request_id,
            "lease_expires_at": expires_at,
            "layout": self.layout.model_dump(),
            "transport": self.transport.name,
        }

    def cancel_export(self, request_id: str) -> bool:
        cancelled = self.leases.cancel(request_id)
        if cancelled and self.metrics:
            self.metrics.leases.labels("cancelled").inc()
        return cancelled

    def _check_export(self, request_id: str, block_ids: list[int]) -> None:
        leased = self.leases.block_ids(request_id)
        if leased is None:
            raise PermissionError(f"request {request_id!r} holds no lease here")
        if not set(block_ids) <= set(leased):
            raise PermissionError(f"blocks asked for are not leased to request {request_id!r}")

    def _on_release(self, request_id: str) -> None:
        if self.metrics:
            self.metrics.leased_blocks.set(self.leases.num_leased_blocks)
        self._release(request_id)

    async def _watch(self) -> None:
        while True:
            for request_id in self.transport.completed():
                if self.leases.complete(request_id) and self.metrics:
                    self.metrics.leases.labels("notified").inc()
            for _ in self.leases.expire():
                if self.metrics:
                    self.metrics.leases.labels("expired").inc()
            # Polling drives the transport's progress (NIXL runs without its progress thread),
            # so poll fast while exports are out, and leave the idle wait as soon as one is
            # granted: a receiver's READ makes no progress until this side polls (waiting out
            # the idle interval cost every pull ~35 ms; bench/sim_profile.py measured it).
            if len(self.leases):
                await asyncio.sleep(self._watch_interval_s)
            else:
                self._exported.clear()
                try:
                    await asyncio.wait_for(self._exported.wait(), self._idle_interval_s)
                except TimeoutError:
                    pass

    # ---- receiving side -----------------------------------------------------------------------

    async def peer(self, engine_id: str | None, url: str) -> PeerMetadata:
        """The metadata of the worker at `url` (cached per engine id), layout checked."""
        if engine_id is not None and engine_id in self._peers:
            return self._peers[engine_id]
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        try:
            resp = await self._http.get(f"{url.rstrip('/')}/kv/metadata", headers=headers)
        except httpx.HTTPError as e:
            raise TransferError(f"could not reach {url} for KV metadata: {e}") from e
        if resp.status_code != 200:
            raise TransferError(f"KV metadata from {url}: HTTP {resp.status_code} {resp.text[:200]}")
        peer = PeerMetadata.model_validate(resp.json())
        if peer.transport != self.transport.name:
            raise TransferError(f"peer {peer.engine_id} speaks {peer.transport!r}, "
                                f"this worker {self.transport.name!r}")
        self.layout.check_compatible(peer.layout)
        if engine_id is not None and peer.engine_id != engine_id:
            raise TransferError(f"{url} is engine {peer.engine_id!r}, expected {engine_id!r}")
        self._peers[peer.engine_id] = peer
        return peer

    def forget_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)
        forget = getattr(self.transport, "forget_peer", None)
        if forget is not None:
            forget(engine_id)

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        """Nothing to pull (every block is already here): let the sender free its lease."""
        await self.transport.notify(peer, request_id)

    async def fetch(
        self,
        peer: PeerMetadata,
        request_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> PullStats:
        """Pull `remote_block_ids` of `peer` into `local_block_ids`; raises TransferError."""
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError("remote and local block lists differ in length")
        peer.layout.check_block_ids(remote_block_ids, "remote")
        self.layout.check_block_ids(local_block_ids, "local")
        label = self.transport.label
        try:
            stats = await self.transport.pull(peer, request_id, remote_block_ids, local_block_ids)
        except TransferError as e:
            if self.metrics:
                reason = "timeout" if isinstance(e, TransferTimeout) else "error"
                self.metrics.failures.labels(label, reason).inc()
            self.forget_peer(peer.engine_id)
            raise
        if self.metrics:
            label = stats.transport_label or label
            self.metrics.bytes.labels(label).inc(stats.num_bytes)
            self.metrics.blocks.labels(label).inc(stats.num_blocks)
            self.metrics.seconds.labels(label).observe(stats.seconds)
        return stats
