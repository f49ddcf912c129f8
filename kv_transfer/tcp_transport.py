"""TCP fallback transport for machines without NIXL: sockets on the event loop
(kv_transfer/socket_stream.py), an authentication preamble then length-prefixed JSON headers
validated by their schemas (kv_transfer/tcp_wire.py: challenge, preamble, pull, answer, done,
notify), block bytes in chunks of [8-byte xxh3_64 LE][bytes].

On a CPU cache the payload is the blocks themselves, sent from and received into the caches
without staging (kv_transfer/payload.py). From a GPU cache, or with `fp8` (per block: its e4m3
bytes then its float32 scales, one per layer and K/V, from `kernels.fp8_pack`), the blocks go
through two host buffers, pinned on a GPU, the device copies overlapping the socket
(kv_transfer/tcp_pipeline.py); a staged sender sends one checksummed chunk per unit.

This module is the receiving side (`pull`, `notify`); the sending side, the data port, is
kv_transfer/tcp_server.py. Unlike one-sided NIXL reads the sender sees each request, so it
checks the token (the preamble) and that the asked-for blocks are the ones leased to that
request id.
"""

from __future__ import annotations

import asyncio
import time

import torch
import xxhash
from pydantic import ValidationError

from common.background import BackgroundErrors
from kv_transfer import tcp_wire as wire
from kv_transfer.layout import KVLayout
from kv_transfer.payload import Regions, block_views
from kv_transfer.side_stream import SideStream
from kv_transfer.socket_stream import SocketStream
from kv_transfer.tcp_pipeline import HostBuffers, RecvUnits, staged
from kv_transfer.tcp_server import TcpServer
from kv_transfer.transport import (
    PeerMetadata,
    PullStats,
    TransferError,
    TransferTimeout,
    TransportConfig,
)


class TcpTransport:
    name = "tcp"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self._buffers = HostBuffers(kv_cache.device)  # pinned on a GPU, reused across pulls
        self._side = SideStream(kv_cache.device)
        self.server = TcpServer(kv_cache, layout, config, self._buffers, self._side)

    @property
    def errors(self) -> BackgroundErrors:
        return self.server.errors

    @errors.setter
    def errors(self, errors: BackgroundErrors) -> None:  # the connector hands its own in
        self.server.errors = errors

    @property
    def label(self) -> str:
        return "tcp"

    @property
    def port(self) -> int | None:
        return self.server.port

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        await self.server.close()

    def metadata(self) -> PeerMetadata:
        return PeerMetadata(
            engine_id=self.config.engine_id,
            transport=self.name,
            layout=self.layout,
            params={"host": self.config.advertise_host or self.config.listen_host,
                    "port": self.server.port},
        )

    def set_export_check(self, check) -> None:
        self.server.set_export_check(check)

    def completed(self) -> list[str]:
        return self.server.completed()

    # ---- receiver ---------------------------------------------------------------------------

    @staticmethod
    def _address(peer: PeerMetadata) -> tuple[str, int]:
        try:
            params = wire.TcpParams.model_validate(peer.params)
        except ValidationError as e:
            raise TransferError(f"invalid tcp metadata from {peer.engine_id}: "
                                f"{e.errors()[0]['msg']}") from e
        return params.host, params.port

    async def _open(self, peer: PeerMetadata) -> SocketStream:
        """A connection to `peer`'s data port with its challenge answered (the preamble goes
        out with the first header)."""
        conn = await SocketStream.connect(*self._address(peer))
        try:
            await wire.answer_challenge(conn, self.config.token)
        except BaseException:
            conn.close()
            raise
        return conn

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        async def send() -> None:
            conn = await self._open(peer)
            try:
                await wire.write_header(conn, {"op": "notify", "request_id": request_id})
            finally:
                conn.close()

        try:
            await asyncio.wait_for(send(), self.config.pull_timeout_s)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
            raise TransferError(f"tcp notification to {peer.engine_id} failed: {e}") from e

    async def pull(
        self,
        peer: PeerMetadata,
        request_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        staged_slots: list[int] | None = None,  # the TCP sender gathers per pull itself
    ) -> PullStats:
        try:
            return await asyncio.wait_for(
                self._pull(peer, request_id, remote_block_ids, local_block_ids),
                self.config.pull_timeout_s,
            )
        except TimeoutError as e:
            raise TransferTimeout(
                f"tcp pull of {len(remote_block_ids)} blocks from {peer.engine_id} timed out "
                f"after {self.config.pull_timeout_s} s") from e
        except (OSError, asyncio.IncompleteReadError) as e:
            raise TransferError(f"tcp pull from {peer.engine_id} failed: {e}") from e

    async def _recv_staged(self, conn: SocketStream, resp: wire.Accepted,
                           local_block_ids: list[int], fp8: bool) -> int:
        recv = RecvUnits(self.kv_cache, local_block_ids, self.layout, fp8, self.config.chunk_bytes,
                         self._buffers, self._side)
        try:
            expected = recv.num_bytes
            wire.check_size(resp, expected)
            for start in range(0, expected, resp.chunk_bytes):
                (want,) = wire.CHECKSUM.unpack(await conn.readexactly(wire.CHECKSUM.size))
                size = min(resp.chunk_bytes, expected - start)
                digest = xxhash.xxh3_64()
                async for view in recv.views(start, start + size):
                    await conn.read_into(view)
                    digest.update(view)
                wire.check_digest(digest, want, start, size)
            await recv.finish()
        finally:
            recv.close()
        return expected

    async def _pull(self, peer, request_id, remote_block_ids, local_block_ids) -> PullStats:
        t0 = time.perf_counter()
        conn = await self._open(peer)
        try:
            fp8 = self.config.fp8
            await wire.write_header(conn, {"op": "pull", "request_id": request_id,
                                           "block_ids": list(remote_block_ids), "fp8": fp8})
            resp = await wire.read_header(conn, wire.ANSWER, wire.MAX_ANSWER_BYTES)
            if isinstance(resp, wire.Refused):
                raise TransferError(f"peer {peer.engine_id} refused the pull: {resp.error}")
            n = len(remote_block_ids)
            if staged(self.kv_cache, fp8, self.config.staging):
                expected = await self._recv_staged(conn, resp, local_block_ids, fp8)
            else:  # straight into this cache's blocks: they are this request's, unused yet
                expected = n * self.layout.bytes_per_block
                regions = Regions(block_views(self.kv_cache, local_block_ids))
                wire.check_size(resp, expected)
                for start in range(0, expected, resp.chunk_bytes):
                    (want,) = wire.CHECKSUM.unpack(await conn.readexactly(wire.CHECKSUM.size))
                    size = min(resp.chunk_bytes, expected - start)
                    digest = xxhash.xxh3_64()
                    for piece in regions.pieces(start, start + size):
                        await conn.read_into(piece)
                        digest.update(piece)
                    wire.check_digest(digest, want, start, size)
            await wire.write_header(conn, {"op": "done", "request_id": request_id})
        finally:
            conn.close()
        return PullStats(num_blocks=n, num_bytes=expected, seconds=time.perf_counter() - t0,
                         num_descriptors=0, transport_label="tcp+fp8" if fp8 else "tcp")
