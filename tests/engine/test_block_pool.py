import pytest

from common.block_events import BlockEvent
from common.hashing import BlockHasher
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def test_allocate_free_and_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(RuntimeError, match="only 1 free"):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])


def test_cached_blocks_survive_free_until_evicted_lru():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, [10, 11, 12], strict=True):
        pool.cache_block(b, h)
    assert pool.drain_events() == [BlockEvent("stored", (10, 11, 12))]
    pool.free([blocks[2], blocks[1], blocks[0]])  # tail first
    assert pool.lookup([10, 11, 12]) == blocks  # still hits after free
    # Reusing one block evicts the least recently freed: the tail (hash 12).
    pool.allocate(1)
    assert pool.lookup([10, 11, 12]) == blocks[:2]
    assert pool.drain_events() == [BlockEvent("removed", (12,))]


def test_touch_takes_hits_off_free_list():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 99)
    pool.free([b])
    assert pool.num_free_blocks == 2
    pool.touch([b])
    assert pool.num_free_blocks == 1 and pool.blocks[b].ref_cnt == 1
    pool.touch([b])
    assert pool.blocks[b].ref_cnt == 2


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 5)
    pool.cache_block(b, 5)
    assert pool.lookup([5]) == [a] and pool.blocks[b].block_hash is None


def test_reset_only_when_idle():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 1)
    assert not pool.reset_prefix_cache()
    pool.free([a])
    assert pool.reset_prefix_cache() and pool.lookup([1]) == []
    assert pool.drain_events()[-1] == BlockEvent("cleared")


def test_manager_prefix_hits_leave_last_token_to_compute():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, BlockHasher("m", 4))
    first = Sequence("a", list(range(8)), SamplingParams())
    assert kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.cache_computed_blocks(first)
    assert pool.num_cached_blocks == 2
    # Same 8 tokens again: only the first block may be reused (the last token must be computed).
    again = Sequence("b", list(range(8)), SamplingParams())
    assert kv.computed_prefix(again) == first.block_table[:1]
    longer = Sequence("c", list(range(9)), SamplingParams())
    prefix = kv.computed_prefix(longer)
    assert prefix == first.block_table
    assert kv.allocate(longer, 1, prefix)
    assert longer.num_cached_tokens == 8 and len(longer.block_table) == 3
    kv.free(first)
    kv.free(longer)
    assert pool.num_free_blocks == 8


def test_manager_refuses_without_side_effects():
    pool = BlockPool(2)
    kv = KVCacheManager(pool, 4, BlockHasher("m", 4))
    seq = Sequence("a", list(range(12)), SamplingParams())
    assert not kv.allocate(seq, 12)
    assert seq.block_table == [] and pool.num_free_blocks == 2
