"""Per-sequence block accounting on top of the `BlockPool`: prefix-cache lookup at admission,
slot allocation as a sequence grows, hashing of blocks as they fill, and freeing.

With KV tiers (engine/kv_tiers.py), a prefix continues past the device pool's hits in the host
and disk tiers. At the scheduler's admission (`start_load`) the sequence takes device blocks for
its device hits and for the blocks to reload, the tiers' loader thread fills them
(engine/kv_loader.py), and the sequence waits in the scheduler's loading state, not scheduled,
while the running streams' steps go on. `finished_loads` hands back the sequences whose load is
done: the blocks that loaded are cached (they join the prefix cache, and the sequence's
admission finds them as device hits), every block is freed, and what did not load (a file gone
or corrupt) is computed. A sequence freed while loading (aborted) leaves its blocks to the load,
which frees them once its copies are over: no copy lands in a block another sequence got.
`computed_prefix` (imports) and `cached_prefix` (prefix pins) reload on the caller's thread
instead: they need the blocks before they answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.hashing import BlockHasher
from engine.block_pool import BlockPool
from engine.kv_loader import Load
from engine.kv_tiers import KVTiers
from engine.sequence import Sequence


@dataclass(eq=False)
class _Loading:
    seq: Sequence
    load: Load
    block_ids: list[int]  # the sequence's blocks: its device hits, then the ones being filled
    aborted: bool = False  # the sequence is gone: the blocks are freed once the load is done


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, hasher: BlockHasher,
                 tiers: KVTiers | None = None, inline_load_s: float = 0.0) -> None:
        """`inline_load_s`: a load predicted to take at most this long runs at admission, on
        this thread (the stall is shorter than the step a loading sequence waits)."""
        self.pool = pool
        self.block_size = block_size
        self.hasher = hasher
        self.tiers = tiers
        self.inline_load_s = inline_load_s
        self._loads: list[_Loading] = []

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def computed_prefix(self, seq: Sequence, reload: bool = True) -> list[int]:
        """Cached blocks for the longest prefix of `seq`, leaving at least one token to compute
        (the last position's logits are needed to sample); with `reload`, the tiers' blocks
        past the device hits are reloaded first, on this thread."""
        self.update_hashes(seq, seq.num_tokens - 1)
        hits = self.pool.lookup(seq.block_hashes)
        if (reload and self.tiers is not None and self.pool.enable_caching
                and len(hits) < len(seq.block_hashes)):
            hits = self._reload(seq.block_hashes, hits, seq.reloaded_media)
        return hits

    def cached_prefix(self, block_hashes: list[int]) -> list[int]:
        """Device blocks of the longest prefix of `block_hashes` held in any tier (the lower
        tiers' blocks reloaded, as at admission): what a peer prefix export pins."""
        hits = self.pool.lookup(block_hashes)
        if self.tiers is not None and self.pool.enable_caching and len(hits) < len(block_hashes):
            hits = self._reload(block_hashes, hits, {})
        return hits

    def _reload(self, block_hashes: list[int], hits: list[int],
                reloaded_media: dict[int, str]) -> list[int]:
        """Continue the device prefix `hits` with blocks reloaded from the tiers below (each
        one's tier recorded in `reloaded_media`); the longer device prefix."""
        rest = block_hashes[len(hits):]
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
                reloaded_media[block_hash] = medium
            self.pool.free(list(reversed(block_ids)))  # cached (or, past a failure, plain) free
        finally:
            self.pool.free(list(reversed(hits)))
        return self.pool.lookup(block_hashes)

    # ---- loads from the tiers (the scheduler's loading state) ---------------------------------

    def start_load(self, seq: Sequence) -> bool:
        """At admission of `seq` (holding no blocks): if its prefix continues past the device
        hits in a lower tier, take blocks for the hits and for the blocks to load, start the
        copies, and return True: `seq` is loading until `finished_loads` returns it. False, and
        nothing held, when there is nothing to load, no free block for it, `seq` loaded already
        at this admission, or the load is short enough to run here and now (`inline_load_s`):
        then its blocks are in the prefix cache already."""
        if self.tiers is None or not self.pool.enable_caching or seq.tier_loaded:
            return False
        self.update_hashes(seq, seq.num_tokens - 1)
        hits = self.pool.lookup(seq.block_hashes)
        rest = seq.block_hashes[len(hits):]
        media = self.tiers.lookup(rest) if rest else []
        num = min(len(media), self.pool.num_free_blocks - self.pool.num_unreferenced(hits))
        if num <= 0:
            return False
        if self.tiers.reload_seconds(media[:num]) <= self.inline_load_s:
            self._reload(seq.block_hashes, hits, seq.reloaded_media)
            seq.tier_loaded = True
            return False
        self.pool.touch(hits)  # the blocks allocated below must not evict the device hits
        block_ids = self.pool.allocate(num)
        load = Load(rest[:num], media[:num], block_ids)
        seq.block_table = hits + block_ids
        self._loads.append(_Loading(seq, load, list(seq.block_table)))
        self.tiers.loader.submit(load)
        return True

    @property
    def num_loads(self) -> int:
        """Loads in flight, an aborted sequence's included (its blocks are still held)."""
        return len(self._loads)

    def wait_loads(self, timeout_s: float) -> bool:
        """Until a load in flight is done, at most `timeout_s`; whether one is."""
        return bool(self._loads) and self.tiers.loader.wait(
            [x.load for x in self._loads], timeout_s)

    def finished_loads(self) -> list[Sequence]:
        """The loading sequences whose load is done, in the order they started, holding no
        blocks: each block that loaded is in the prefix cache now (recorded in the sequence's
        `reloaded_media`), and admission computes the rest. An aborted sequence's blocks are
        freed here."""
        done, still = [], []
        for x in self._loads:
            (done if x.load.done else still).append(x)
        self._loads = still
        out = []
        for x in done:
            load = x.load
            for block_id, block_hash, medium in zip(load.block_ids[:load.num_loaded],
                                                    load.block_hashes, load.media, strict=False):
                self.pool.cache_block(block_id, block_hash)
                if not x.aborted and self.pool.blocks[block_id].block_hash == block_hash:
                    x.seq.reloaded_media[block_hash] = medium
            # cached (or, past a failure, plain) free; the tail first
            self.pool.free(list(reversed(x.block_ids)))
            if not x.aborted:
                x.seq.block_table = []
                x.seq.tier_loaded = True
                out.append(x.seq)
        return out

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
        loading = next((x for x in self._loads if x.seq is seq), None)
        if loading is not None:  # its blocks are being written: freed once the load is done
            loading.aborted = True
            self.tiers.loader.cancel(loading.load)
            seq.block_table = []
        if seq.block_table:
            self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.num_published_blocks = 0
