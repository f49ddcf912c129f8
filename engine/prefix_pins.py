"""Cached blocks pinned by hash, for the two ends of a peer prefix pull (issue 42; the workers'
side is worker/prefix_export.py and worker/peer_pull.py).

Holder: `pin` takes a reference on the cached blocks of a prompt's leading hashes (reloading what
its host or disk tier holds, as admission does), so they stay put while a peer reads them, until
`release` (the lease's end). Puller: `reserve` allocates blocks for the leading hashes it lacks;
`commit` then caches the ones the transfer filled under their hashes (they join the prefix cache,
as a computed block does) and frees every reserved block, so the request that follows finds them
at admission and computes only the rest. A block filled by nobody is never cached."""

from __future__ import annotations

from collections.abc import Callable

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager


class PrefixPins:
    def __init__(self, pool: BlockPool, kv: KVCacheManager,
                 wait_for_device: Callable[[], None] = lambda: None) -> None:
        """`wait_for_device`: returns once no step queued on the device still writes blocks (a
        pull must not race those writes into a block just freed), as for KV imports."""
        self.pool, self.kv, self.wait_for_device = pool, kv, wait_for_device
        self._pinned: dict[str, list[int]] = {}  # lease id -> blocks referenced for a reader
        # request id -> (blocks referenced: the local hits, then the reserved ones; the hashes
        # of the reserved ones)
        self._reserved: dict[str, tuple[list[int], list[int]]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._pinned or key in self._reserved

    @property
    def num_pinned_blocks(self) -> int:
        return sum(map(len, self._pinned.values())) + sum(
            len(ids) for ids, _ in self._reserved.values())

    # ---- holder -------------------------------------------------------------------------------

    def pin(self, lease_id: str, block_hashes: list[int]) -> list[int]:
        """Reference the cached blocks of the longest held prefix of `block_hashes` (any tier);
        their ids, leading first (empty: nothing held, nothing pinned)."""
        if lease_id in self:
            raise ValueError(f"{lease_id!r} already pins blocks")
        hits = self.kv.cached_prefix(list(block_hashes))
        if hits:
            self.pool.touch(hits)
            self._pinned[lease_id] = hits
        return list(hits)

    def release(self, key: str) -> bool:
        """Drop what `key` pinned or reserved (uncached); False if it holds nothing."""
        if key in self._reserved:
            self.commit(key, 0)
            return True
        hits = self._pinned.pop(key, None)
        if hits is None:
            return False
        self.pool.free(list(reversed(hits)))
        return True

    # ---- puller -------------------------------------------------------------------------------

    def reserve(self, request_id: str, block_hashes: list[int]) -> tuple[int, list[int]]:
        """(how many leading blocks are cached here already, fresh blocks for the rest of
        `block_hashes`); `MemoryError` when blocks are short, nothing taken."""
        if request_id in self:
            raise ValueError(f"{request_id!r} already reserves blocks")
        hashes = list(block_hashes)
        self.wait_for_device()
        here = self.pool.lookup(hashes)
        num_missing = len(hashes) - len(here)
        if num_missing + self.pool.num_unreferenced(here) > self.pool.num_free_blocks:
            raise MemoryError("not enough free KV blocks to pull a prefix into")
        self.pool.touch(here)  # the allocation below must not evict them
        fresh = self.pool.allocate(num_missing) if num_missing else []
        self._reserved[request_id] = (here + fresh, hashes[len(here):])
        return len(here), fresh

    def commit(self, request_id: str, num_filled: int) -> int:
        """The transfer filled the first `num_filled` reserved blocks: cache those, free every
        reserved block (the uncached ones as plain free blocks). Returns the blocks cached."""
        entry = self._reserved.pop(request_id, None)
        if entry is None:
            return 0
        block_ids, hashes = entry
        fresh = block_ids[len(block_ids) - len(hashes):]
        num_filled = max(0, min(num_filled, len(fresh)))
        for block_id, block_hash in zip(fresh[:num_filled], hashes[:num_filled], strict=True):
            self.pool.cache_block(block_id, block_hash)
        self.pool.free(list(reversed(block_ids)))
        return num_filled
