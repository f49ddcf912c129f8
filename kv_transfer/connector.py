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
from pydantic import ValidationError

from common.background import BackgroundErrors
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.metrics import TransferMetrics
from kv_transfer.transport import (
    PeerMetadata,
    PullStats,
    TransferError,
    TransferTimeout,
    TransportConfig,
)
from kv_transfer.transports import get_transport_class

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 1 << 20


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
        errors: BackgroundErrors | None = None,
        handshake_timeout_s: float = 5.0,
        max_lease_seconds: float | None = None,
    ) -> None:
        self.layout = layout
        self.config = config
        self.transport = get_transport_class(transport)(kv_cache, layout, config)
        self.transport.errors = self.errors = errors or BackgroundErrors()
        self.leases = LeaseTable(self._on_release, lease_seconds, max_seconds=max_lease_seconds)
        self.metrics = metrics
        self.handshake_timeout_s = handshake_timeout_s
        self._release = release
        self._http = http
        self._own_http = http is None
        self._peers: dict[str, tuple[str, PeerMetadata]] = {}  # engine id -> (url, metadata)
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

    def export(self, request_id: str, block_ids: list[int],
               lease_seconds: float | None = None) -> dict:
        """Pin `block_ids` for a receiver; returns the transfer fields of kv_transfer_params."""
        self.layout.check_block_ids(block_ids, "exported")
        expires_at = self.leases.grant(request_id, block_ids, lease_seconds)
        self._exported.set()
        staged_at = self._stage(request_id, block_ids)
        if self.metrics:
            self.metrics.leases.labels("granted").inc()
            self.metrics.leased_blocks.set(self.leases.num_leased_blocks)
        fields = {
            "remote_engine_id": self.config.engine_id,
            "remote_block_ids": list(block_ids),
            "remote_request_id": request_id,
            "lease_expires_at": expires_at,
            "layout": self.layout.model_dump(),
            "transport": self.transport.name,
        }
        if staged_at is not None:
            # Signed with the handle (kv_transfer/handle.py): which slots a receiver may read.
            fields["remote_staging_start"] = staged_at
        return fields

    def _stage(self, request_id: str, block_ids: list[int]) -> int | None:
        """The first staging slot the transport gathered the export into, or None. A failure
        here only costs the fast path: the blocks stay readable where they are."""
        stage = getattr(self.transport, "stage", None)
        if stage is None:
            return None
        try:
            staged_at = stage(request_id, block_ids)
        except Exception as e:  # noqa: BLE001 - the export itself stands
            self.errors.record("kv_staging", e)
            return None
        if self.metrics:
            self.metrics.staging_slots.set(self._staged_slots())
        return staged_at

    def _staged_slots(self) -> int:
        pool = getattr(self.transport, "staging", None)
        return 0 if pool is None else pool.num_leased_slots

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
        unstage = getattr(self.transport, "unstage", None)
        if unstage is not None:
            unstage(request_id)  # the staged copy goes with the lease, on every path
        if self.metrics:
            self.metrics.leased_blocks.set(self.leases.num_leased_blocks)
            self.metrics.staging_slots.set(self._staged_slots())
        self._release(request_id)

    async def _watch(self) -> None:
        while True:
            try:
                self._watch_once()
            except Exception as e:  # noqa: BLE001 - never die: this loop also drives NIXL progress
                self.errors.record("kv_lease_watcher", e)
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

    def _watch_once(self) -> None:
        for request_id in self.transport.completed():
            if self.leases.complete(request_id) and self.metrics:
                self.metrics.leases.labels("notified").inc()
        for _ in self.leases.expire():
            if self.metrics:
                self.metrics.leases.labels("expired").inc()

    # ---- receiving side -----------------------------------------------------------------------

    async def peer(self, engine_id: str, url: str) -> PeerMetadata:
        """The metadata of engine `engine_id` at `url`, layout checked. Both come from a verified
        KV handle (kv_transfer/handle.py); the cache is keyed by that engine id and address,
        never by what a peer claims to be, and the whole handshake has one deadline."""
        cached = self._peers.get(engine_id)
        if cached is not None and cached[0] == url:
            return cached[1]
        try:
            peer = await asyncio.wait_for(self._fetch_metadata(url), self.handshake_timeout_s)
        except TimeoutError as e:
            raise TransferTimeout(f"KV metadata handshake with {url} took over "
                                  f"{self.handshake_timeout_s} s") from e
        if peer.transport != self.transport.name:
            raise TransferError(f"peer {peer.engine_id} speaks {peer.transport!r}, "
                                f"this worker {self.transport.name!r}")
        self.layout.check_compatible(peer.layout)
        if peer.engine_id != engine_id:
            raise TransferError(f"{url} is engine {peer.engine_id!r}, expected {engine_id!r}")
        if cached is not None:
            self.forget_peer(engine_id)  # the engine moved: drop the old address's agent
        self._peers[engine_id] = (url, peer)
        return peer

    async def _fetch_metadata(self, url: str) -> PeerMetadata:
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        try:
            async with self._http.stream("GET", f"{url.rstrip('/')}/kv/metadata",
                                         headers=headers) as resp:
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_METADATA_BYTES:
                        raise TransferError(f"KV metadata from {url} exceeds "
                                            f"{MAX_METADATA_BYTES} bytes")
        except httpx.HTTPError as e:
            raise TransferError(f"could not reach {url} for KV metadata: {e}") from e
        if resp.status_code != 200:
            raise TransferError(f"KV metadata from {url}: HTTP {resp.status_code} "
                                f"{bytes(body[:200])!r}")
        try:
            return PeerMetadata.model_validate_json(bytes(body))
        except ValidationError as e:
            raise TransferError(f"invalid KV metadata from {url}: {e.errors()[0]['msg']}") from e

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
        staged_slots: list[int] | None = None,
    ) -> PullStats:
        """Pull `remote_block_ids` of `peer` into `local_block_ids`; raises TransferError.
        `staged_slots`: where the sender staged each of those blocks (from the handle's
        `remote_staging_start`), if it did; the transport's plan decides whether to read them."""
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError("remote and local block lists differ in length")
        peer.layout.check_block_ids(remote_block_ids, "remote")
        self.layout.check_block_ids(local_block_ids, "local")
        label = self.transport.label
        try:
            if staged_slots is not None and getattr(self.transport, "stage", None) is not None:
                stats = await self.transport.pull(peer, request_id, remote_block_ids,
                                                  local_block_ids, staged_slots=staged_slots)
            else:
                stats = await self.transport.pull(peer, request_id, remote_block_ids,
                                                  local_block_ids)
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
            self.metrics.plans.labels(stats.extra.get("plan", "direct")).inc()
        return stats
