"""Per-sequence block accounting on top of the `BlockPool`: prefix-cache lookup at admission,
slot allocation as a sequence grows, hashing of blocks as they fill, and freeing.

With KV tiers (engine/kv_tiers.py), the prefix lookup continues past the device pool's hits in
the host and disk tiers, and reloads what it finds there into device blocks, which join the
prefix cache: admission then sees them as device hits. The reload is synchronous (a copy per
block from host memory, a file read per block from disk), on the engine's thread."""

from __future__ import annotations

from common.hashing import BlockHasher
from engine.block_pool import BlockPool
from engine.kv_tiers import KVTiers
from engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, hasher: BlockHasher,
                 tiers: KVTiers | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hasher = hasher
        self.tiers = tiers

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def computed_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of `seq`, leaving at least one token to compute
        (the last position's logits are needed to sample)."""
        self.update_hashes(seq, seq.num_tokens - 1)
        hits = self.pool.lookup(seq.block_hashes)
        if (self.tiers is not None and self.pool.enable_caching
                and len(hits) < len(seq.block_hashes)):
            hits = self._reload(seq, hits)
        return hits

    def _reload(self, seq: Sequence, hits: list[int]) -> list[int]:
        """Continue the device prefix `hits` with blocks reloaded from the tiers below; the
        longer device prefix."""
        rest = seq.block_hashes[len(hits):]
        media = self.tiers.lookup(rest)
        if not media:
            return hits
        self.pool.touch(hits)  # the blocks allocated below must not evict the device hits
        try:
            num = min(len(media), self.pool.num_free_blocks)
            block_ids = self.pool.allocate(num)
            num_loaded = self.tiers.reload(rest[:num], media[:num], block_ids)
            loaded = zip(block_ids[:num_loaded], rest[:num_loaded], media[:num_loaded],
                         strict=True)
            for block_id, block_hash, medium in loaded:
                self.pool.cache_block(block_id, block_hash)
                seq.reloaded_media[block_hash] = medium
            self.pool.free(list(reversed(block_ids)))  # cached (or, past a failure, plain) free
        finally:
            self.pool.free(list(reversed(hits)))
        return self.pool.lookup(seq.block_hashes)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int]) -> bool:
        computed = (len(prefix_blocks) * self.block_size if prefix_blocks
                    else seq.num_computed_tokens)
        needed = self.num_blocks_for(computed + num_new_tokens)
        needed -= len(seq.block_table) + len(prefix_blocks)
        return (max(needed, 0) + self.pool.num_unreferenced(prefix_blocks)
                <= self.pool.num_free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens, first adopting `prefix_blocks` (a
        cache hit at admission). Returns False, changing nothing, when blocks are short."""
        prefix_blocks = list(prefix_blocks)
        if not self.can_allocate(seq, num_new_tokens, prefix_blocks):
            return False
        if prefix_blocks:
            self.pool.touch(prefix_blocks)
            seq.block_table.extend(prefix_blocks)
            seq.num_computed_tokens = len(prefix_blocks) * self.block_size
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.num_cached_tokens_by_medium = self._by_medium(seq, len(prefix_blocks))
        needed = (self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
                  - len(seq.block_table))
        if needed > 0:
            seq.block_table.extend(self.pool.allocate(needed))
        return True

    def _by_medium(self, seq: Sequence, num_blocks: int) -> dict[str, int]:
        """Cached tokens of `seq`'s first `num_blocks` blocks by the tier they came from."""
        out = {"device": 0, "host": 0, "disk": 0}
        for block_hash in seq.block_hashes[:num_blocks]:
            out[seq.reloaded_media.get(block_hash, "device")] += self.block_size
        return out

    def update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.block_hashes` to cover the full blocks among its first `num_tokens`."""
        have = len(seq.block_hashes)
        want = num_tokens // self.block_size
        if want <= have:
            return
        parent = seq.block_hashes[-1] if have else None
        tokens = [seq.token_at(i) for i in range(have * self.block_size, want * self.block_size)]
        seq.block_hashes.extend(self.hasher(tokens, parent, seq.cache_salt))

    def cache_computed_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Publish the blocks that became full (all tokens computed) to the prefix cache;
        `num_tokens`: how many are computed, if not `seq.num_computed_tokens` (a step still
        in flight has advanced it: engine/decode_pipeline.py)."""
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        self.update_hashes(seq, num_tokens)
        n = min(num_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_published_blocks, n):
            self.pool.cache_block(seq.block_table[i], seq.block_hashes[i])
        seq.num_published_blocks = max(seq.num_published_blocks, n)

    def free_after(self, seq: Sequence, num_blocks: int) -> None:
        """Free `seq`'s blocks past its first `num_blocks`."""
        self.pool.free(list(reversed(seq.block_table[num_blocks:])))
        seq.block_table = seq.block_table[:num_blocks]

    def free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.num_published_blocks = 0
