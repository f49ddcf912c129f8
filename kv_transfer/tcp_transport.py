"""TCP fallback transport for machines without NIXL: asyncio streams, length-prefixed JSON
headers, block bytes in checksummed chunks.

    request  (receiver -> sender): {"op": "pull", "request_id", "block_ids", "token", "fp8"}
    response (sender -> receiver): {"ok": true, "num_bytes", "chunk_bytes"} then chunks of
                                   [8-byte xxh3_64 LE][bytes]; or {"ok": false, "error"}
    done     (receiver -> sender): {"op": "done", "request_id"}
    notify   (receiver -> sender): {"op": "notify", "request_id", "token"}  (nothing to pull)

With `fp8` the payload is the e4m3 bytes of the staged blocks followed by their float32 scales
(one per (block, layer, K/V) run), packed by `kernels.fp8_pack` (a CUDA kernel on GPU caches).

Unlike one-sided NIXL reads the sender sees each request, so it checks the token and that the
asked-for blocks are the ones leased to that request id.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import struct
import time

import numpy as np
import torch
import xxhash

from kv_transfer import kernels
from kv_transfer.layout import KVLayout
from kv_transfer.transport import (
    PeerMetadata,
    PullStats,
    TransferError,
    TransferTimeout,
    TransportConfig,
)

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_CHECKSUM = struct.Struct("<Q")
_MAX_HEADER = 1 << 20


async def _write_header(writer: asyncio.StreamWriter, obj: dict) -> None:
    data = json.dumps(obj).encode()
    writer.write(_HEADER.pack(len(data)) + data)
    await writer.drain()


async def _read_header(reader: asyncio.StreamReader) -> dict:
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if n > _MAX_HEADER:
        raise TransferError(f"header of {n} bytes is too large")
    return json.loads(await reader.readexactly(n))


class TcpTransport:
    name = "tcp"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self._server: asyncio.base_events.Server | None = None
        self._port: int | None = None
        self._done: list[str] = []
        self._check = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def label(self) -> str:
        return "tcp"

    @property
    def port(self) -> int | None:
        return self._port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.config.listen_host, self.config.port)
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("tcp transport listening on %s:%d", self.config.listen_host, self._port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            req = await _read_header(reader)
            if req.get("op") == "notify":
                if self._token_ok(req) and self._check_lease(str(req.get("request_id"))):
                    self._done.append(str(req["request_id"]))
                return
            error = self._refusal(req)
            if error:
                await _write_header(writer, {"ok": False, "error": error})
                return
            block_ids = [int(b) for b in req["block_ids"]]
            staging = kernels.gather_blocks(self.kv_cache, block_ids)  # [n, L, 2, BS, H, D]
            if req.get("fp8"):
                q, scales = kernels.fp8_pack(staging)  # q: uint8 like staging; scales [n, L, 2]
                payload = np.concatenate([q.reshape(-1).cpu().numpy(),
                                          scales.reshape(-1).cpu().numpy().view(np.uint8)])
            else:
                payload = staging.contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
            chunk = self.config.chunk_bytes
            await _write_header(writer, {"ok": True, "num_bytes": int(payload.size), "chunk_bytes": chunk})
            view = memoryview(payload)
            for start in range(0, payload.size, chunk):
                piece = view[start : start + chunk]
                writer.write(_CHECKSUM.pack(xxhash.xxh3_64_intdigest(piece)))
                writer.write(piece)
                await writer.drain()
            done = await _read_header(reader)
            if done.get("op") == "done" and done.get("request_id") == req["request_id"]:
                self._done.append(req["request_id"])
        except (asyncio.IncompleteReadError, ConnectionError, json.JSONDecodeError, TransferError) as e:
            log.info("tcp transport: peer connection ended early: %s", e)
        finally:
            self._handlers.discard(task)
            writer.close()

    def _token_ok(self, req: dict) -> bool:
        token = self.config.token
        return not token or hmac.compare_digest(str(req.get("token", "")), token)

    def _check_lease(self, request_id: str) -> bool:
        if self._check is None:
            return True
        try:
            self._check(request_id, [])
        except (ValueError, PermissionError):
            return False
        return True

    def _refusal(self, req: dict) -> str | None:
        if req.get("op") != "pull":
            return "expected a pull request"
        if not self._token_ok(req):
            return "invalid internal token"
        block_ids = req.get("block_ids")
        if not isinstance(block_ids, list) or not block_ids:
            return "block_ids must be a non-empty list"
        try:
            self.layout.check_block_ids(block_ids, "requested")
            if self._check is not None:
                self._check(str(req.get("request_id")), block_ids)
        except (ValueError, PermissionError) as e:
            return str(e)
        return None

    # ---- receiver ---------------------------------------------------------------------------

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(peer.params["host"], int(peer.params["port"])),
                self.config.pull_timeout_s)
            await _write_header(writer, {"op": "notify", "request_id": request_id,
                                         "token": self.config.token or ""})
            writer.close()
        except (OSError, TimeoutError) as e:
            raise TransferError(f"tcp notification to {peer.engine_id} failed: {e}") from e

    async def pull(
        self,
        peer: PeerMetadata,
        request_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
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

    async def _pull(self, peer, request_id, remote_block_ids, local_block_ids) -> PullStats:
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection(peer.params["host"], int(peer.params["port"]))
        try:
            fp8 = self.config.fp8
            await _write_header(writer, {"op": "pull", "request_id": request_id,
                                         "block_ids": list(remote_block_ids),
                                         "token": self.config.token or "", "fp8": fp8})
            resp = await _read_header(reader)
            if not resp.get("ok"):
                raise TransferError(f"peer {peer.engine_id} refused the pull: {resp.get('error')}")
            n = len(remote_block_ids)
            lay = self.layout
            shape = (n, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
            num_runs = n * lay.num_layers * 2
            if fp8:
                expected = num_runs * (lay.run_bytes // lay.element_size) + num_runs * 4
                buf = np.empty(expected, dtype=np.uint8)
            else:
                expected = n * lay.bytes_per_block
                staging = torch.empty(shape, dtype=self.kv_cache.dtype)
                buf = staging.view(torch.uint8).reshape(-1).numpy()
            if resp["num_bytes"] != expected:
                raise TransferError(f"peer sent {resp['num_bytes']} bytes, expected {expected}")
            chunk = int(resp["chunk_bytes"])
            for start in range(0, expected, chunk):
                (want,) = _CHECKSUM.unpack(await reader.readexactly(_CHECKSUM.size))
                size = min(chunk, expected - start)
                data = await reader.readexactly(size)
                if xxhash.xxh3_64_intdigest(data) != want:
                    raise TransferError(f"checksum mismatch in bytes {start}..{start + size}")
                buf[start : start + size] = np.frombuffer(data, dtype=np.uint8)
            if fp8:
                num_q = expected - num_runs * 4
                q = torch.from_numpy(buf[:num_q]).reshape(shape).to(self.kv_cache.device)
                scales = torch.from_numpy(buf[num_q:].view(np.float32)).reshape(shape[:3])
                staging = kernels.fp8_unpack(q, scales.to(self.kv_cache.device), self.kv_cache.dtype)
            kernels.scatter_blocks(self.kv_cache, local_block_ids, staging.to(self.kv_cache.device))
            await _write_header(writer, {"op": "done", "request_id": request_id})
        finally:
            writer.close()
        return PullStats(num_blocks=n, num_bytes=expected, seconds=time.perf_counter() - t0,
                         num_descriptors=0, transport_label="tcp+fp8" if fp8 else "tcp")
