"""The KV tiers below the device pool: a host tier (engine/host_tier.py) and, optionally, a disk
tier (engine/disk_tier.py), behind the small API the engine uses.

- Offload (`offload`, from engine/block_pool.py): a full, hashed block that becomes unreferenced
  is queued; a thread of this object copies it into the host tier. Before the pool hands such a
  block out again it calls `evicting`: a copy not started yet is dropped (counted), one in
  progress is waited for (one block's copy). A full host tier spills its least recently used
  block to the disk tier on the same thread (or drops it, without one).
- Reload (`lookup`, `reload`, from engine/kv_cache_manager.py at admission): the chain of block
  hashes past the device prefix is continued in host, then disk; the hits are copied into
  device blocks the caller allocated.
- Events (`drain_events`): `stored` / `removed` with the medium (host, disk) of the tier that
  gained or lost the block, beside the device pool's; `hashes_by_medium` for a full resync.
- `stats`: counters per tier and the measured reload rate of each (engine/tier_stats.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from common.block_events import BlockEvent
from engine.config import EngineConfig
from engine.disk_tier import DiskTier
from engine.host_tier import HostTier
from engine.tier_file import BlockFormat
from engine.tier_stats import TierStats
from kv_transfer.layout import KV_ORDER

log = logging.getLogger(__name__)

# With a disk tier but no host tier, this many host slots stage the writes.
STAGING_SLOTS = 16


class KVTiers:
    def __init__(self, kv_cache: torch.Tensor, block_size: int, host: HostTier,
                 disk: DiskTier | None = None) -> None:
        self.kv_cache = kv_cache
        self.host = host
        self.disk = disk
        self.stats_ = TierStats(host.block_bytes, block_size)
        self._cond = threading.Condition()
        self._pending: OrderedDict[int, int] = OrderedDict()  # block id -> hash, oldest first
        self._copying: int | None = None  # the block id whose copy runs now
        self._to_disk: OrderedDict[int, None] = OrderedDict()  # host blocks not on disk yet
        self._working = False  # the thread is on a copy, write or spill
        self._events: list[BlockEvent] = []
        self._closing = False
        if disk is not None:
            found = disk.scan()
            if found:
                log.info("disk tier: %d blocks from %s", len(found), disk.folder)
                self._events.append(BlockEvent("stored", tuple(found), "disk"))
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    # ---- offload (the block pool's hooks, on the engine's thread) ---------------------------

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
        """Copies or writes queued, or events not drained (the engine's loop polls while so)."""
        with self._cond:
            return bool(self._pending or self._to_disk or self._events or self._working)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued copy and disk write is done (tests, shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._pending or self._to_disk
                                                    or self._working) or self._closing,
                                       timeout_s)

    def _run(self) -> None:
        """The tiers' thread: device -> host copies first (they race the pool's evictions),
        then host -> disk writes (write-through, so a restart finds what the host held)."""
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

    # ---- reload (at admission, on the engine's thread) ---------------------------------------

    def lookup(self, block_hashes: list[int]) -> list[str]:
        """The tier of each of the leading `block_hashes` held below the device (host first)."""
        media: list[str] = []
        with self._cond:
            for h in block_hashes:
                if h in self.host:
                    media.append("host")
                elif self.disk is not None and h in self.disk:
                    media.append("disk")
                else:
                    break
        return media

    def reload(self, block_hashes: list[int], media: list[str], block_ids: list[int]) -> int:
        """Copy each block (from the tier `lookup` named) into the device block beside it, in
        order, stopping at the first that is gone or fails its checks; how many were copied."""
        seconds = {"host": 0.0, "disk": 0.0}
        counts = {"host": 0, "disk": 0}
        num = 0
        for block_hash, medium, block_id in zip(block_hashes, media, block_ids, strict=True):
            self.stats_.counters[medium].hit_blocks += 1
            dst = self.kv_cache[block_id]
            t0 = time.perf_counter()
            if medium == "host":
                with self._cond:
                    slot = self.host.slot(block_hash)
                    if slot is not None:
                        dst.copy_(self.host.slab[slot])
                        self.host.touch(block_hash)
                ok = slot is not None
            else:
                ok = self.disk is not None and self.disk.read_into(
                    block_hash, dst.view(torch.uint8).view(-1))
            if not ok:
                break
            seconds[medium] += time.perf_counter() - t0
            counts[medium] += 1
            num += 1
        for medium, n in counts.items():
            self.stats_.reloaded(medium, n, seconds[medium])
        return num

    # ---- publishing -------------------------------------------------------------------------

    def drain_events(self) -> list[BlockEvent]:
        """Tier events since the last drain, consecutive ones of a kind and medium merged."""
        with self._cond:
            events, self._events = self._events, []
        merged: list[BlockEvent] = []
        for ev in events:
            last = merged[-1] if merged else None
            if last is not None and (last.kind, last.medium) == (ev.kind, ev.medium):
                merged[-1] = BlockEvent(ev.kind, last.block_hashes + ev.block_hashes, ev.medium)
            else:
                merged.append(ev)
        return merged

    def hashes_by_medium(self) -> dict[str, list[int]]:
        """What each tier holds now; the events not drained yet are reflected, so dropped."""
        with self._cond:
            self._events.clear()
            return {"host": self.host.hashes(),
                    "disk": self.disk.hashes() if self.disk is not None else []}

    def stats(self) -> dict:
        """`kv_tiers`: the counters and holdings of each tier; `reload_tokens_per_s`."""
        with self._cond:
            return self.stats_.report(self.host, self.disk)

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Stop the thread, after letting queued copies and writes run for at most
        `flush_timeout_s` (a restart then finds them on disk); what the tiers hold stays."""
        self.wait_idle(flush_timeout_s)
        with self._cond:
            self._closing = True
            self._pending.clear()
            self._to_disk.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if self.disk is not None:
            self.disk.close()


def build_kv_tiers(config: EngineConfig, kv_cache: torch.Tensor, model_digest: str,
                   hash_seed: int) -> KVTiers | None:
    """The tiers `config` asks for, or None (no host bytes and no disk folder, or no prefix
    caching)."""
    if not config.enable_prefix_caching or (config.host_kv_bytes <= 0
                                             and config.disk_kv_dir is None):
        return None
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    num_slots = (config.host_kv_bytes // block_bytes if config.host_kv_bytes > 0
                 else STAGING_SLOTS)
    if num_slots < 1:
        raise ValueError(f"the host tier's {config.host_kv_bytes} bytes hold no block "
                         f"of {block_bytes} bytes")
    host = HostTier(num_slots, tuple(kv_cache.shape[1:]), kv_cache.dtype,
                    pin_memory=kv_cache.device.type == "cuda")
    disk = None
    if config.disk_kv_dir is not None:
        fmt = BlockFormat(model_digest=model_digest, layout=KV_ORDER,
                          block_size=config.block_size, hash_seed=hash_seed,
                          dtype=str(kv_cache.dtype).removeprefix("torch."),
                          shape=tuple(kv_cache.shape[1:]), element_size=kv_cache.element_size())
        disk = DiskTier(config.disk_kv_dir, config.disk_kv_bytes, fmt)
    return KVTiers(kv_cache, config.block_size, host, disk)
