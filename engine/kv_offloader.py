"""The KV tiers' offload path (engine/kv_tiers.py): device blocks the pool lets go are copied into
the host tier, and host blocks are written through to the disk tier, on a thread of their own
(`kv-tiers`), never on the engine's step.

A full, hashed block that becomes unreferenced is queued (`offload`). Before the pool hands such
a block out again it calls `evicting`: a copy not started yet is dropped (counted), one in
progress is waited for (one block's copy). A full host tier spills its least recently used block
to the disk tier on the same thread (or drops it, without one). Work is dropped rather than
waited for: the engine never blocks on a tier beyond one block's copy.

The host and disk tiers, the counters and the event list are the tiers' (shared with the loader,
engine/kv_loader.py); `lock` guards them and this class's queues.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from common.block_events import BlockEvent
from engine.disk_tier import DiskTier
from engine.host_tier import HostTier
from engine.tier_stats import TierStats

log = logging.getLogger(__name__)


class Offloader:
    def __init__(self, kv_cache: torch.Tensor, host: HostTier, disk: DiskTier | None,
                 stats: TierStats, events: list[BlockEvent], lock: threading.Condition) -> None:
        self.kv_cache = kv_cache
        self.host, self.disk, self.stats_, self._events = host, disk, stats, events
        self._cond = lock
        self._pending: OrderedDict[int, int] = OrderedDict()  # block id -> hash, oldest first
        self._copying: int | None = None  # the block id whose copy runs now
        self._to_disk: OrderedDict[int, None] = OrderedDict()  # host blocks not on disk yet
        self._working = False  # the thread is on a copy, write or spill
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    # ---- the block pool's hooks (on the engine's thread) ---------------------------------------

    def offload(self, block_id: int, block_hash: int) -> None:
        """Block `block_id`, holding `block_hash`, is unreferenced: copy it down (later)."""
        with self._cond:
            if self._closing or block_hash in self.host:
                return
            self._pending[block_id] = block_hash
            self._pending.move_to_end(block_id)
            self._cond.notify_all()

    def evicting(self, block_id: int) -> None:
        """Block `block_id` is about to be overwritten: no copy of it may run after this."""
        with self._cond:
            if self._pending.pop(block_id, None) is not None:
                self.stats_.dropped("host")
            while self._copying == block_id:
                self._cond.wait()

    @property
    def busy(self) -> bool:
        """Copies or writes queued or running (the caller holds the lock)."""
        return bool(self._pending or self._to_disk or self._working)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued copy and disk write is done (or the thread stops)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.busy or self._closing, timeout_s)

    def close(self, flush_timeout_s: float) -> None:
        """Stop the thread, after letting queued copies and writes run for at most
        `flush_timeout_s` (a restart then finds them on disk)."""
        self.wait_idle(flush_timeout_s)
        with self._cond:
            self._closing = True
            self._pending.clear()
            self._to_disk.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ---- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        """Device -> host copies first (they race the pool's evictions), then host -> disk writes
        (write-through, so a restart finds what the host held)."""
        while True:
            write, victim, slot = None, None, None
            with self._cond:
                while not (self._pending or self._to_disk or self._closing):
                    self._cond.wait()
                if self._closing:
                    return
                self._working = True
                if self._pending:
                    slot = self.host.take_slot()
                    victim = self.host.evict_lru() if slot is None else None
                else:
                    block_hash = self._to_disk.popitem(last=False)[0]
                    slot = self.host.slot(block_hash)
                    write = (block_hash, slot) if slot is not None else None
            # Slots change hands on this thread only: one read outside the lock stays valid.
            try:
                if write is not None:
                    self._write(*write)
                elif victim is not None:
                    self._spill(*victim)
                elif slot is not None:
                    self._copy_one(slot)
            except Exception:  # noqa: BLE001 - a tier's failure never stops the worker
                log.exception("kv tiers: a copy or write failed")
            finally:
                with self._cond:
                    self._working = False
                    self._cond.notify_all()

    def _copy_one(self, slot: int) -> None:
        """Copy the oldest queued device block into host `slot`."""
        with self._cond:
            if not self._pending:
                self.host.release_slot(slot)
                return
            block_id, block_hash = self._pending.popitem(last=False)
            self._copying = block_id
        t0, copied = time.perf_counter(), False
        try:
            self.host.slab[slot].copy_(self.kv_cache[block_id])
            copied = True
        except Exception:  # noqa: BLE001 - the block is dropped, the tier goes on
            log.exception("host tier: a block copy failed")
        with self._cond:
            self._copying = None
            if not copied or block_hash in self.host:
                self.host.release_slot(slot)
                if not copied:
                    self.stats_.dropped("host")
            else:
                self.host.put(block_hash, slot)
                self._events.append(BlockEvent("stored", (block_hash,), "host"))
                self.stats_.offloaded("host", 1, time.perf_counter() - t0)
                disk = self.disk
                if disk is not None and disk.stopped is None and block_hash not in disk:
                    self._to_disk[block_hash] = None

    def _write(self, block_hash: int, slot: int) -> bool:
        """Write host `slot` (holding `block_hash`) to the disk tier; whether it is there."""
        disk = self.disk
        if disk is None:
            return False
        if block_hash in disk:
            return True
        if disk.stopped is not None:
            return False
        t0, stored, evicted = time.perf_counter(), False, []
        payload = memoryview(self.host.slab[slot].view(torch.uint8).view(-1).numpy())
        try:
            stored, evicted = disk.write(block_hash, payload)
        except Exception:  # noqa: BLE001 - the tier drops the block, the worker goes on
            log.exception("disk tier: writing a block failed")
        with self._cond:
            if stored:
                self.stats_.offloaded("disk", 1, time.perf_counter() - t0)
            else:
                self.stats_.dropped("disk")
            if evicted:
                self._events.append(BlockEvent("removed", tuple(evicted), "disk"))
            if stored:
                self._events.append(BlockEvent("stored", (block_hash,), "disk"))
        return stored

    def _spill(self, block_hash: int, slot: int) -> None:
        """The host tier's LRU block `block_hash` (still in `slot`) leaves host memory: to the
        disk tier if it is not there yet (and can be), else it is gone from this worker."""
        with self._cond:
            self._to_disk.pop(block_hash, None)
        self._write(block_hash, slot)
        with self._cond:
            self.host.release_slot(slot)
            self._events.append(BlockEvent("removed", (block_hash,), "host"))
