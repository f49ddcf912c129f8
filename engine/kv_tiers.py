"""The KV tiers below the device pool: a host tier (engine/host_tier.py) and, optionally, a disk
tier (engine/disk_tier.py), behind the small API the engine uses. Two threads do the copies, each
its own class: the `Offloader` (engine/kv_offloader.py) moves blocks down, the `Loader`
(engine/kv_loader.py) fills device blocks from them; this class holds what they share (the
tiers, the counters, the events and the lock that guards them).

- Offload (`offload`, `evicting`: the block pool's hooks, engine/block_pool.py): a full, hashed
  block that becomes unreferenced is copied into the host tier, and written through to disk, off
  the engine's step; one about to be overwritten is never read after that.
- Reload (`lookup`, then `loader.submit` at admission, engine/kv_cache_manager.py): the chain of
  block hashes past the device prefix is continued in host, then disk; the hits are copied into
  device blocks the caller allocated, while the sequence waits in the scheduler's loading state.
  `reload` does the same on the caller's thread.
- Events (`drain_events`): `stored` / `removed` with the medium (host, disk) of the tier that
  gained or lost the block, beside the device pool's; `hashes_by_medium` for a full resync.
- `stats`: counters per tier and the measured reload rate of each (engine/tier_stats.py).
"""

from __future__ import annotations

import logging
import threading

import torch

from common.block_events import BlockEvent
from engine.config import EngineConfig
from engine.disk_tier import DiskTier
from engine.host_tier import HostTier
from engine.kv_loader import Loader
from engine.kv_offloader import Offloader
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
        self._cond = threading.Condition()  # the tiers, the counters, the events
        self._events: list[BlockEvent] = []
        if disk is not None:
            found = disk.scan()
            if found:
                log.info("disk tier: %d blocks from %s", len(found), disk.folder)
                self._events.append(BlockEvent("stored", tuple(found), "disk"))
        self.offloader = Offloader(kv_cache, host, disk, self.stats_, self._events, self._cond)
        self.loader = Loader(kv_cache, host, disk, self.stats_, self._cond)

    # ---- offload (the block pool's hooks, on the engine's thread) ---------------------------

    def offload(self, block_id: int, block_hash: int) -> None:
        """Block `block_id`, holding `block_hash`, is unreferenced: copy it down (later)."""
        self.offloader.offload(block_id, block_hash)

    def evicting(self, block_id: int) -> None:
        """Block `block_id` is about to be overwritten: no copy of it may run after this."""
        self.offloader.evicting(block_id)

    @property
    def busy(self) -> bool:
        """Copies, writes or loads queued, or events not drained (the engine's loop polls while
        so)."""
        if self.loader.busy:
            return True
        with self._cond:
            return bool(self._events) or self.offloader.busy

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued copy and disk write is done (tests, shutdown)."""
        return self.offloader.wait_idle(timeout_s)

    # ---- reload -----------------------------------------------------------------------------

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

    def reload_seconds(self, media: list[str]) -> float:
        """How long a reload of one block from each of `media` takes at the rates measured so
        far (inf while a tier's is not measured)."""
        return self.stats_.reload_seconds(media)

    def reload(self, block_hashes: list[int], media: list[str], block_ids: list[int]) -> int:
        """Copy each block (from the tier `lookup` named) into the device block beside it, in
        order, on this thread, stopping at the first that is gone or fails its checks; how many
        were copied."""
        return self.loader.load_now(block_hashes, media, block_ids)

    # ---- publishing -------------------------------------------------------------------------

    def drain_events(self) -> list[BlockEvent]:
        """Tier events since the last drain, consecutive ones of a kind and medium merged."""
        with self._cond:
            events = list(self._events)
            self._events.clear()  # the list itself is the offloader's too
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
        """Stop both threads, after letting queued copies and writes run for at most
        `flush_timeout_s` (a restart then finds them on disk); what the tiers hold stays."""
        self.loader.close()
        self.offloader.close(flush_timeout_s)
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
