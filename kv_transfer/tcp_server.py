"""The TCP transport's sending side: the data port a worker serves its leased blocks on
(kv_transfer/tcp_wire.py is the wire; kv_transfer/tcp_transport.py the receiving side).

Every connection is a stranger until its preamble proves the internal token, and a stranger gets
little: a task, a socket with the kernel's default buffers, 36 bytes read and one deadline
(`handshake_timeout_s`, for the preamble and the request header together). At most
`MAX_HANDSHAKES` strangers are held at once: one more closes the oldest, so a flood of idle
connections costs a bounded amount and an honest peer, whose handshake takes a round trip, gets
through it. Authenticated connections are capped at `MAX_CONNECTIONS` (one more is refused).
A request header is capped at what an honest pull from this cache can need and parsed off the
event loop when large. Then the sender checks that the asked-for blocks are leased to the
request id it names.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import torch
import xxhash

from common.background import BackgroundErrors
from kv_transfer import tcp_wire as wire
from kv_transfer.layout import KVLayout
from kv_transfer.payload import Regions, block_views
from kv_transfer.side_stream import SideStream
from kv_transfer.socket_stream import SocketStream, enlarge_buffers
from kv_transfer.tcp_pipeline import HostBuffers, SendUnits, staged
from kv_transfer.transport import TransferError, TransportConfig

log = logging.getLogger(__name__)

MAX_HANDSHAKES = 64  # connections not yet authenticated; one more closes the oldest
MAX_CONNECTIONS = 256  # authenticated connections being served; one more is refused
LISTEN_BACKLOG = 128


class TcpServer:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig,
                 buffers: HostBuffers, side: SideStream) -> None:
        self.kv_cache, self.layout, self.config = kv_cache, layout, config
        self._buffers, self._side = buffers, side
        self.max_request_bytes = wire.max_request_bytes(layout.num_blocks)
        self.errors = BackgroundErrors()
        self.port: int | None = None
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()
        self._strangers: dict[asyncio.Task, None] = {}  # in arrival order: the oldest first
        self._num_serving = 0
        self._done: list[str] = []
        self._check = None

    @property
    def num_connections(self) -> int:
        return len(self._handlers)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.config.listen_host, self.config.port,
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        self._listener = socket.socket(family, kind, proto)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(address)
        self._listener.listen(LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._acceptor = asyncio.create_task(self._accept(), name="tcp-transport-accept")
        log.info("tcp transport listening on %s:%d", self.config.listen_host, self.port)

    async def close(self) -> None:
        if self._listener is not None:
            self._acceptor.cancel()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(self._acceptor, *self._handlers, return_exceptions=True)
            self._listener.close()
            self._listener = None

    def set_export_check(self, check) -> None:
        self._check = check

    def completed(self) -> list[str]:
        done, self._done = self._done, []
        return done

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as e:  # out of descriptors, a reset before accept: keep serving
                self.errors.record("tcp_transport_server", e)
                await asyncio.sleep(0.05)
                continue
            if len(self._strangers) >= MAX_HANDSHAKES:
                oldest = next(iter(self._strangers))
                del self._strangers[oldest]
                oldest.cancel()
                self.errors.record("tcp_transport_server", f"over {MAX_HANDSHAKES} connections "
                                   "awaiting their preamble: closed the oldest", key="evicted")
            task = asyncio.create_task(self._serve(SocketStream(conn, large_buffers=False)))
            self._handlers.add(task)
            self._strangers[task] = None
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._handlers.discard(task)
        self._strangers.pop(task, None)

    async def _read_request(self, conn: SocketStream):
        try:
            return await wire.read_header(conn, wire.REQUEST, self.max_request_bytes)
        except TransferError as e:
            await wire.write_header(conn, {"ok": False, "error": str(e)})
            raise

    async def _serve(self, conn: SocketStream) -> None:
        me = asyncio.current_task()
        authenticated = False
        try:
            # A peer that trickles holds a connection, not a request: one deadline for the
            # preamble and the header.
            async with asyncio.timeout(self.config.handshake_timeout_s):
                if not await wire.authenticate(conn, self.config.token):
                    self.errors.record("tcp_transport_server", "closed a connection whose "
                                       "preamble does not prove the token", key="preamble")
                    return
                self._strangers.pop(me, None)
                if self._num_serving >= MAX_CONNECTIONS:
                    await wire.write_header(conn, {"ok": False, "error": "too many connections"})
                    return
                self._num_serving += 1
                authenticated = True
                req = await self._read_request(conn)
            if isinstance(req, wire.NotifyHeader):
                if self._check_lease(req.request_id):
                    self._done.append(req.request_id)
                return
            error = self._refusal(req)
            if error:
                await wire.write_header(conn, {"ok": False, "error": error})
                return
            enlarge_buffers(conn.sock)
            await self._send(conn, req)
            done = await wire.read_header(conn, wire.DoneHeader, wire.MAX_DONE_BYTES)
            if done.request_id == req.request_id:
                self._done.append(req.request_id)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, TransferError) as e:
            if authenticated:
                log.info("tcp transport: peer connection ended early: %s", e)
            elif me in self._strangers:  # counted, its log line rate-limited: strangers flood
                self.errors.record("tcp_transport_server", "a connection ended before its "
                                   f"preamble ({type(e).__name__})", key="no_preamble")
        except Exception as e:  # noqa: BLE001 - one peer's connection never takes the server down
            self.errors.record("tcp_transport_server", e)
        finally:
            self._num_serving -= authenticated
            conn.close()

    async def _send(self, conn: SocketStream, req: wire.PullHeader) -> None:
        block_ids = req.block_ids
        if staged(self.kv_cache, req.fp8, self.config.staging):
            await self._send_staged(conn, block_ids, req.fp8)
            return
        # Straight from the cache's own blocks.
        regions = Regions(block_views(self.kv_cache, block_ids))
        chunk = self.config.chunk_bytes
        total = regions.num_bytes
        await wire.write_header(conn, {"ok": True, "num_bytes": total, "chunk_bytes": chunk})
        for start in range(0, total, chunk):
            pieces = regions.pieces(start, min(start + chunk, total))
            digest = xxhash.xxh3_64()
            for piece in pieces:
                digest.update(piece)
            conn.write(wire.CHECKSUM.pack(digest.intdigest()))
            for piece in pieces:
                await conn.send(piece)

    async def _send_staged(self, conn: SocketStream, block_ids: list[int], fp8: bool) -> None:
        send = SendUnits(self.kv_cache, block_ids, self.layout, fp8, self.config.chunk_bytes,
                         self._buffers, self._side)
        try:
            total = len(block_ids) * send.rec
            await wire.write_header(conn, {"ok": True, "num_bytes": total,
                                           "chunk_bytes": send.unit_bytes})
            async for view in send:  # one wire chunk a unit
                conn.write(wire.CHECKSUM.pack(xxhash.xxh3_64_intdigest(view)))
                await conn.send(view)
        finally:
            send.close()

    def _check_lease(self, request_id: str) -> bool:
        if self._check is None:
            return True
        try:
            self._check(request_id, [])
        except (ValueError, PermissionError):
            return False
        return True

    def _refusal(self, req: wire.PullHeader) -> str | None:
        try:
            self.layout.check_block_ids(req.block_ids, "requested")
            if self._check is not None:
                self._check(req.request_id, req.block_ids)
        except (ValueError, PermissionError) as e:
            return str(e)
        return None
