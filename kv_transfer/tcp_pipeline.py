"""The TCP transport's staged payload: blocks of a GPU cache (or FP8-packed blocks) move through
two host buffers (pinned on a GPU), the device copies overlapping the socket.

Payload: one record per block, in the pull's order. A record is the block's bytes, or with FP8
its e4m3 bytes then its float32 scales (one per layer and K/V: `kernels.fp8_pack`). Records are
grouped in units of whole blocks, each side choosing its own unit size from its chunk size:

    sender    unit k: gather (+ pack) on the side stream -> host buffer k % 2 (non_blocking)
              while unit k-1's buffer is on the socket
    receiver  the byte stream fills host buffer u % 2; a full unit goes host -> device on the
              side stream, is unpacked and scattered, while the next unit arrives

A buffer is refilled only after its previous copy finished (an event). On a CPU cache the same
code runs with plain buffers and synchronous copies (the CPU twin of the GPU path).
"""

from __future__ import annotations

import torch

from kv_transfer import kernels
from kv_transfer.layout import KVLayout
from kv_transfer.side_stream import SideStream

MAX_IDLE_BUFFERS = 8  # host buffers kept for reuse (pinning 16 MiB costs milliseconds)


def staged(cache: torch.Tensor, fp8: bool, staging: str) -> bool:
    """Whether a pull goes through host buffers: a GPU cache, FP8 packing, or staging forced
    (`staging == "always"`); a CPU cache otherwise sends and receives in place."""
    return fp8 or cache.is_cuda or staging == "always"


def record_bytes(layout: KVLayout, fp8: bool) -> int:
    if not fp8:
        return layout.bytes_per_block
    elems = layout.bytes_per_block // layout.element_size
    return elems + layout.num_layers * 2 * 4


def blocks_per_unit(layout: KVLayout, fp8: bool, chunk_bytes: int, min_bytes: int = 1 << 12) -> int:
    """Whole blocks in one unit of about `chunk_bytes` (at least one, and at least `min_bytes`)."""
    rec = record_bytes(layout, fp8)
    k = max(1, chunk_bytes // rec)
    while k * rec < min_bytes:
        k += 1
    return k


def units(num_blocks: int, per_unit: int) -> list[tuple[int, int]]:
    """(first block, count) of each unit of a pull of `num_blocks`."""
    if per_unit < 1:
        raise ValueError("a unit holds at least one block")
    return [(i, min(per_unit, num_blocks - i)) for i in range(0, num_blocks, per_unit)]


class HostBuffers:
    """Host staging buffers, pinned when the cache is on a GPU, reused across pulls."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self._idle: list[torch.Tensor] = []

    def acquire(self, nbytes: int) -> torch.Tensor:
        for i, buf in enumerate(self._idle):
            if buf.numel() >= nbytes:
                return self._idle.pop(i)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def release(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        if len(self._idle) < MAX_IDLE_BUFFERS:
            self._idle.append(base)

    @property
    def num_idle(self) -> int:
        return len(self._idle)


def _pack(cache: torch.Tensor, block_ids: list[int], fp8: bool) -> torch.Tensor:
    """The records of `block_ids`: [k, record_bytes] uint8 on the cache's device."""
    staging = kernels.gather_blocks(cache, block_ids)  # [k, L, 2, BS, H, D]
    k = staging.shape[0]
    if not fp8:
        return staging.view(torch.uint8).reshape(k, -1)
    q, scales = kernels.fp8_pack(staging)  # q uint8 like staging; scales [k, L, 2]
    return torch.cat([q.reshape(k, -1), scales.reshape(k, -1).view(torch.uint8)], dim=1)


def _unpack(records: torch.Tensor, layout: KVLayout, dtype: torch.dtype, fp8: bool) -> torch.Tensor:
    """[k, record_bytes] uint8 -> [k, L, 2, BS, H, D] of the cache's dtype."""
    k = records.shape[0]
    shape = (k, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if not fp8:
        return records.view(dtype).reshape(shape)
    elems = layout.bytes_per_block // layout.element_size
    q = records[:, :elems].contiguous().reshape(shape)
    scales = records[:, elems:].contiguous().view(torch.float32).reshape(shape[:3])
    return kernels.fp8_unpack(q, scales, dtype)


class SendUnits:
    """Sender: prepares unit k+1 on the device while unit k is sent. Use as an async iterator of
    host byte views; `close()` gives the buffers back (on every path)."""

    def __init__(self, cache: torch.Tensor, block_ids: list[int], layout: KVLayout, fp8: bool,
                 chunk_bytes: int, buffers: HostBuffers, side: SideStream) -> None:
        self.cache, self.block_ids, self.fp8, self.side = cache, block_ids, fp8, side
        self.rec = record_bytes(layout, fp8)
        self.per_unit = blocks_per_unit(layout, fp8, chunk_bytes)
        self.units = units(len(block_ids), self.per_unit)
        self.buffers = buffers
        self._bufs = [buffers.acquire(self.per_unit * self.rec)
                      for _ in range(min(2, len(self.units)))]
        self._events: list = [None, None]

    @property
    def unit_bytes(self) -> int:
        return self.per_unit * self.rec

    def _prepare(self, u: int) -> None:
        first, count = self.units[u]
        buf = self._bufs[u % 2][: count * self.rec]
        with self.side:
            records = _pack(self.cache, self.block_ids[first: first + count], self.fp8)
            buf.copy_(records.reshape(-1), non_blocking=True)
        self._events[u % 2] = self.side.record()

    async def __aiter__(self):
        if not self.units:
            return
        self._prepare(0)
        for u in range(len(self.units)):
            if u + 1 < len(self.units):
                self._prepare(u + 1)  # its buffer's previous unit (u - 1) was sent already
            await SideStream.wait(self._events[u % 2])
            count = self.units[u][1]
            yield memoryview(self._bufs[u % 2][: count * self.rec].numpy())

    def close(self) -> None:
        self.side.synchronize()  # no copy may still write into a buffer given back
        for buf in self._bufs:
            self.buffers.release(buf)
        self._bufs = []


class RecvUnits:
    """Receiver: hands out host views to receive the payload into, in order, and lands each full
    unit in the cache on the side stream while the next one arrives. `finish()` waits for the
    last; `close()` gives the buffers back (on every path)."""

    def __init__(self, cache: torch.Tensor, local_block_ids: list[int], layout: KVLayout, fp8: bool,
                 chunk_bytes: int, buffers: HostBuffers, side: SideStream) -> None:
        self.cache, self.local_block_ids, self.layout = cache, local_block_ids, layout
        self.fp8, self.side = fp8, side
        self.rec = record_bytes(layout, fp8)
        self.per_unit = blocks_per_unit(layout, fp8, chunk_bytes)
        self.units = units(len(local_block_ids), self.per_unit)
        self.num_bytes = len(local_block_ids) * self.rec
        self.buffers = buffers
        self._bufs = [buffers.acquire(self.per_unit * self.rec)
                      for _ in range(min(2, len(self.units)))]
        self._events: list = [None, None]
        self._unit_bytes = self.per_unit * self.rec

    async def views(self, start: int, end: int):
        """Writable host views covering payload bytes [start, end), in order; a unit that these
        bytes complete is landed before the next view is handed out."""
        while start < end:
            u, offset = divmod(start, self._unit_bytes)
            count = self.units[u][1]
            if offset == 0:
                await SideStream.wait(self._events[u % 2])  # the buffer's last unit has landed
            stop = min(end, u * self._unit_bytes + count * self.rec)
            yield memoryview(self._bufs[u % 2].numpy())[offset: offset + stop - start]
            start = stop
            if stop == u * self._unit_bytes + count * self.rec:
                self._land(u)

    def _land(self, u: int) -> None:
        first, count = self.units[u]
        host = self._bufs[u % 2][: count * self.rec]
        with self.side:
            records = host.to(self.cache.device, non_blocking=True).reshape(count, self.rec)
            blocks = _unpack(records, self.layout, self.cache.dtype, self.fp8)
            kernels.scatter_blocks(self.cache, self.local_block_ids[first: first + count], blocks)
        self._events[u % 2] = self.side.record()

    async def finish(self) -> None:
        for event in self._events:
            await SideStream.wait(event)

    def close(self) -> None:
        self.side.synchronize()
        for buf in self._bufs:
            self.buffers.release(buf)
        self._bufs = []
