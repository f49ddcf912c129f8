"""The engine's KV store: the paged KV cache tensor, the block pool over it with its prefix
cache, the host and disk tiers below it (engine/kv_tiers.py), the KV cache manager that
allocates a sequence's blocks, and the pins of a peer prefix export (engine/prefix_pins.py).
What leaves the worker about its blocks (block events, full block sets by tier, tier stats)
is read here."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.block_events import BlockEvent
from common.hashing import BlockHasher
from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import allocate_kv_cache, num_blocks_for_memory
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers import build_kv_tiers
from engine.prefix_pins import PrefixPins

_DEFAULT_KV_BYTES = 1 << 30


class KVStore:
    def __init__(self, config: EngineConfig, mc: ModelConfig, model_digest: str,
                 dtype: torch.dtype, device: torch.device,
                 wait_device: Callable[[], object]) -> None:
        """`wait_device()`: until the step in flight (if any) has run, before blocks it may
        still write are handed to a transfer."""
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks or num_blocks_for_memory(
            config.kv_memory_bytes or _DEFAULT_KV_BYTES, mc, self.block_size, dtype)
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: one registrable
        # region in which each block (all layers, K and V) is one contiguous run, so moving a
        # block to another worker is one descriptor (see kv_transfer/layout.py).
        self.kv_cache = allocate_kv_cache(
            (self.num_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim),
            dtype, device, config.kv_cache_path)
        self.hasher = BlockHasher(model_digest, self.block_size, config.hash_salt)
        # Host and disk tiers below the device pool, if configured (engine/kv_tiers.py).
        self.tiers = build_kv_tiers(config, self.kv_cache, model_digest, self.hasher.seed)
        self.pool = BlockPool(self.num_blocks, enable_caching=config.enable_prefix_caching,
                              offloader=self.tiers)
        self.kv = KVCacheManager(self.pool, self.block_size, self.hasher, self.tiers,
                                 config.inline_load_s)
        self.pins = PrefixPins(self.pool, self.kv, wait_device)

    def drain_events(self) -> list[BlockEvent]:
        events = self.pool.drain_events()
        return events + self.tiers.drain_events() if self.tiers is not None else events

    def cached_hashes(self) -> list[int]:
        """Every cached block hash, for a full rewrite of this worker's block set; the events
        not yet drained are reflected in it, so they are dropped."""
        self.pool.drain_events()
        return self.pool.cached_hashes()

    def cached_hashes_by_medium(self) -> dict[str, list[int]]:
        """`cached_hashes` for every tier (device, host, disk); drops every undrained event."""
        self.pool.drain_events()
        tiers = self.tiers.hashes_by_medium() if self.tiers is not None else {}
        return {"device": self.pool.cached_hashes(), "host": tiers.get("host", []),
                "disk": tiers.get("disk", [])}

    @property
    def background_busy(self) -> bool:
        """Tier copies queued or tier events not drained: the loops poll for events while so."""
        return self.tiers is not None and self.tiers.busy

    def close(self) -> None:
        """Stop the tiers' threads."""
        if self.tiers is not None:
            self.tiers.close()

    def stats(self) -> dict:
        """The store's part of the worker's load: blocks free, evictable, pinned; with tiers,
        their counters under `kv_tiers` and `reload_tokens_per_s` by tier."""
        return {"free_blocks": self.pool.num_free_blocks,
                "evictable_blocks": self.pool.num_evictable_blocks,
                "num_blocks": self.num_blocks, "pinned_blocks": self.pins.num_pinned_blocks,
                **(self.tiers.stats() if self.tiers is not None else {})}
