"""The pool of KV-cache blocks: reference counts, an LRU free list whose blocks keep their
contents (so a freed block can still be a prefix-cache hit until it is reused), the
hash -> block map, and the stream of block events that workers publish to the router's index.

With KV tiers (engine/kv_tiers.py) an `offloader` is told when a cached block becomes unreferenced
(copy it down, off the step) and before such a block is handed out again (the copy must not read
it after that)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from common.block_events import BlockEvent


class BlockOffloader(Protocol):
    def offload(self, block_id: int, block_hash: int) -> None:
        """Cached block `block_id` is unreferenced: its contents may be copied (later)."""

    def evicting(self, block_id: int) -> None:
        """Block `block_id` is about to be overwritten: return once no copy of it runs."""


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass
class BlockPool:
    num_blocks: int
    enable_caching: bool = True
    offloader: BlockOffloader | None = None
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)  # LRU order: first = evicted first
    _cached: dict[int, int] = field(init=False)  # block hash -> block id
    _events: list[BlockEvent] = field(init=False)
    _num_evictable: int = field(init=False)  # free blocks that still hold a cached block

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}
        self._events = []
        self._num_evictable = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, possibly still holding cached contents)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a cached block: handing one out evicts a prefix-cache
        entry (the rest of the free blocks hold nothing). Kept as a count: `stats` reads it at
        every step."""
        return self._num_evictable

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the LRU end of the free list, evicting their cached contents."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, only {len(self._free)} free")
        out: list[int] = []
        removed: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._num_evictable -= 1
                if self.offloader is not None:
                    self.offloader.evicting(block_id)
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                    removed.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        if removed:
            self._events.append(BlockEvent("removed", tuple(removed)))
        return out

    def lookup(self, block_hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes`."""
        hits: list[int] = []
        if not self.enable_caching:
            return hits
        for h in block_hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (taking them off the free list if unreferenced)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                self._num_evictable -= block.block_hash is not None
            block.ref_cnt += 1

    def num_unreferenced(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; unreferenced blocks go to the MRU end of the free
        list in the given order (callers pass a sequence's blocks tail first, so the tail of a
        prompt is evicted before its shared head)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                self._num_evictable += block.block_hash is not None
                if block.block_hash is not None and self.offloader is not None:
                    self.offloader.offload(block_id, block.block_hash)

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Record that `block_id` holds the full block with `block_hash`."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds these tokens; this copy stays anonymous
        block.block_hash = block_hash
        self._num_evictable += block.ref_cnt == 0
        self._cached[block_hash] = block_id
        self._events.append(BlockEvent("stored", (block_hash,)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            if block.block_hash is not None and self.offloader is not None:
                self.offloader.evicting(block.block_id)
            block.block_hash = None
        self._cached.clear()
        self._num_evictable = 0
        self._events.append(BlockEvent("cleared"))
        return True

    def cached_hashes(self) -> list[int]:
        """Every block hash held now (for a full resync of the router's index)."""
        return list(self._cached)

    def drain_events(self) -> list[BlockEvent]:
        """Events since the last drain, merging consecutive `stored` events."""
        events, self._events = self._events, []
        merged: list[BlockEvent] = []
        for ev in events:
            if merged and merged[-1].kind == ev.kind and ev.kind != "cleared":
                merged[-1] = BlockEvent(ev.kind, merged[-1].block_hashes + ev.block_hashes)
            else:
                merged.append(ev)
        return merged
