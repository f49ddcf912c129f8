"""TCP fallback transport for machines without NIXL: sockets on the event loop
(kv_transfer/socket_stream.py), length-prefixed JSON headers validated by their schemas
(kv_transfer/tcp_wire.py: pull, answer, done, notify), block bytes in chunks of
[8-byte xxh3_64 LE][bytes].

On a CPU cache the payload is the blocks themselves, sent from and received into the caches
without staging (kv_transfer/payload.py). From a GPU cache, or with `fp8` (per block: its e4m3
bytes then its float32 scales, one per layer and K/V, from `kernels.fp8_pack`), the blocks go
through two host buffers, pinned on a GPU, the device copies overlapping the socket
(kv_transfer/tcp_pipeline.py); a staged sender sends one checksummed chunk per unit.

Unlike one-sided NIXL reads the sender sees each request, so it checks the token and that the
asked-for blocks are the ones leased to that request id.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import torch
import xxhash
from pydantic import ValidationError

from common.auth import secrets_equal
from common.background import BackgroundErrors
from kv_transfer import tcp_wire as wire
from kv_transfer.layout import KVLayout
from kv_transfer.payload import Regions, block_views
from kv_transfer.side_stream import SideStream
from kv_transfer.socket_stream import SocketStream
from kv_transfer.tcp_pipeline import HostBuffers, RecvUnits, SendUnits
from kv_transfer.transport import (
    PeerMetadata,
    PullStats,
    TransferError,
    TransferTimeout,
    TransportConfig,
)

log = logging.getLogger(__name__)

class TcpTransport:
    name = "tcp"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task | None = None
        self._port: int | None = None
        self._done: list[str] = []
        self._check = None
        self._handlers: set[asyncio.Task] = set()
        self.errors = BackgroundErrors()  # the connector hands its own in (one registry)
        self._buffers = HostBuffers(kv_cache.device)  # pinned on a GPU, reused across pulls
        self._side = SideStream(kv_cache.device)

    @property
    def label(self) -> str:
        return "tcp"

    @property
    def port(self) -> int | None:
        return self._port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.config.listen_host, self.config.port,
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        self._listener = socket.socket(family, kind, proto)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(address)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._port = self._listener.getsockname()[1]
        self._acceptor = asyncio.create_task(self._accept(), name="tcp-transport-accept")
        log.info("tcp transport listening on %s:%d", self.config.listen_host, self._port)

    async def close(self) -> None:
        if self._listener is not None:
            self._acceptor.cancel()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(self._acceptor, *self._handlers, return_exceptions=True)
            self._listener.close()
            self._listener = None

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as e:  # out of descriptors, a reset before accept: keep serving
                self.errors.record("tcp_transport_server", e)
                await asyncio.sleep(0.05)
                continue
            task = asyncio.create_task(self._serve(SocketStream(conn)))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def metadata(self) -> PeerMetadata:
        return PeerMetadata(
            engine_id=self.config.engine_id,
            transport=self.name,
            layout=self.layout,
            params={"host": self.config.advertise_host or self.config.listen_host, "port": self._port},
        )

    def set_export_check(self, check) -> None:
        self._check = check

    def completed(self) -> list[str]:
        done, self._done = self._done, []
        return done

    # ---- sender -----------------------------------------------------------------------------

    async def _serve(self, conn: SocketStream) -> None:
        reader = writer = conn
        try:
            try:
                # A peer that trickles its header holds a connection, not a request: one deadline.
                req = await asyncio.wait_for(wire.read_header(reader, wire.REQUEST),
                                             self.config.handshake_timeout_s)
            except TransferError as e:
                await wire.write_header(writer, {"ok": False, "error": str(e)})
                raise
            if isinstance(req, wire.NotifyHeader):
                if self._token_ok(req.token) and self._check_lease(req.request_id):
                    self._done.append(req.request_id)
                return
            error = self._refusal(req)
            if error:
                await wire.write_header(writer, {"ok": False, "error": error})
                return
            block_ids = req.block_ids
            if self._staged(req.fp8):
                await self._send_staged(conn, block_ids, req.fp8)
            else:  # straight from the cache's own blocks
                regions = Regions(block_views(self.kv_cache, block_ids))
                chunk = self.config.chunk_bytes
                total = regions.num_bytes
                await wire.write_header(writer, {"ok": True, "num_bytes": total, "chunk_bytes": chunk})
                for start in range(0, total, chunk):
                    pieces = regions.pieces(start, min(start + chunk, total))
                    digest = xxhash.xxh3_64()
                    for piece in pieces:
                        digest.update(piece)
                    writer.write(wire.CHECKSUM.pack(digest.intdigest()))
                    for piece in pieces:
                        await conn.send(piece)
            done = await wire.read_header(reader, wire.DoneHeader)
            if done.request_id == req.request_id:
                self._done.append(req.request_id)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, TransferError) as e:
            log.info("tcp transport: peer connection ended early: %s", e)
        except Exception as e:  # noqa: BLE001 - one peer's connection never takes the server down
            self.errors.record("tcp_transport_server", e)
        finally:
            conn.close()

    def _staged(self, fp8: bool) -> bool:
        """Through host buffers (kv_transfer/tcp_pipeline.py): a GPU cache, FP8 packing, or
        staging forced; a CPU cache otherwise sends and receives in place."""
        return fp8 or self.kv_cache.is_cuda or self.config.staging == "always"

    async def _send_staged(self, conn: SocketStream, block_ids: list[int], fp8: bool) -> None:
        send = SendUnits(self.kv_cache, block_ids, self.layout, fp8, self.config.chunk_bytes,
                         self._buffers, self._side)
        try:
            total = len(block_ids) * send.rec
            await wire.write_header(conn, {"ok": True, "num_bytes": total, "chunk_bytes": send.unit_bytes})
            async for view in send:  # one wire chunk a unit
                conn.write(wire.CHECKSUM.pack(xxhash.xxh3_64_intdigest(view)))
                await conn.send(view)
        finally:
            send.close()

    def _token_ok(self, given: str) -> bool:
        token = self.config.token
        return not token or secrets_equal(given, token)

    def _check_lease(self, request_id: str) -> bool:
        if self._check is None:
            return True
        try:
            self._check(request_id, [])
        except (ValueError, PermissionError):
            return False
        return True

    def _refusal(self, req: wire.PullHeader) -> str | None:
        if not self._token_ok(req.token):
            return "invalid internal token"
        try:
            self.layout.check_block_ids(req.block_ids, "requested")
            if self._check is not None:
                self._check(req.request_id, req.block_ids)
        except (ValueError, PermissionError) as e:
            return str(e)
        return None

    # ---- receiver ---------------------------------------------------------------------------

    @staticmethod
    def _address(peer: PeerMetadata) -> tuple[str, int]:
        try:
            params = wire.TcpParams.model_validate(peer.params)
        except ValidationError as e:
            raise TransferError(f"invalid tcp metadata from {peer.engine_id}: {e.errors()[0]['msg']}") from e
        return params.host, params.port

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        host, port = self._address(peer)
        try:
            conn = await asyncio.wait_for(SocketStream.connect(host, port), self.config.pull_timeout_s)
            try:
                await wire.write_header(conn, {"op": "notify", "request_id": request_id,
                                          "token": self.config.token or ""})
            finally:
                conn.close()
        except (OSError, TimeoutError) as e:
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

    async def _recv_staged(self, conn: SocketStream, resp: wire.Accepted, local_block_ids: list[int],
                           fp8: bool) -> int:
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
        reader = writer = conn = await SocketStream.connect(*self._address(peer))
        try:
            fp8 = self.config.fp8
            await wire.write_header(writer, {"op": "pull", "request_id": request_id,
                                         "block_ids": list(remote_block_ids),
                                         "token": self.config.token or "", "fp8": fp8})
            resp = await wire.read_header(reader, wire.ANSWER)
            if isinstance(resp, wire.Refused):
                raise TransferError(f"peer {peer.engine_id} refused the pull: {resp.error}")
            n = len(remote_block_ids)
            if self._staged(fp8):
                expected = await self._recv_staged(conn, resp, local_block_ids, fp8)
            else:  # straight into this cache's blocks: they are this request's, unused yet
                expected = n * self.layout.bytes_per_block
                regions = Regions(block_views(self.kv_cache, local_block_ids))
                wire.check_size(resp, expected)
                for start in range(0, expected, resp.chunk_bytes):
                    (want,) = wire.CHECKSUM.unpack(await reader.readexactly(wire.CHECKSUM.size))
                    size = min(resp.chunk_bytes, expected - start)
                    digest = xxhash.xxh3_64()
                    for piece in regions.pieces(start, start + size):
                        await conn.read_into(piece)
                        digest.update(piece)
                    wire.check_digest(digest, want, start, size)
            await wire.write_header(writer, {"op": "done", "request_id": request_id})
        finally:
            conn.close()
        return PullStats(num_blocks=n, num_bytes=expected, seconds=time.perf_counter() - t0,
                         num_descriptors=0, transport_label="tcp+fp8" if fp8 else "tcp")
