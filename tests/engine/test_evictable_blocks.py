"""The block pool's count of evictable blocks (free, still holding a cached block), which a worker
publishes as `evictable_blocks` in its load: kept as a count, checked against a recount after
every operation of a random run, and through the engine's published figures."""

from __future__ import annotations

import random

from engine.block_pool import BlockPool


def recount(pool: BlockPool) -> int:
    return sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)


def test_the_count_equals_a_recount_through_a_random_run():
    rng = random.Random(0)
    pool = BlockPool(24)
    held: list[list[int]] = []  # the blocks of each live sequence
    next_hash = 1
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            hashes = rng.sample(range(1, next_hash + 1), k=min(3, next_hash))
            hits = pool.lookup(hashes)
            pool.touch(hits)
            new = pool.allocate(rng.randint(0, min(4, pool.num_free_blocks)))
            for b in new:
                if rng.random() < 0.7:  # a new hash, or one cached already (stays anonymous)
                    fresh = rng.random() < 0.8
                    pool.cache_block(b, next_hash if fresh else rng.randint(1, next_hash))
                    next_hash += 1
            held.append(hits + new)
        elif op < 0.75 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.free(blocks[::-1])
        elif op < 0.78:
            pool.reset_prefix_cache()
        elif held and rng.random() < 0.5:  # a block cached while free (never in the engine)
            free = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
            if free:
                pool.cache_block(rng.choice(free), next_hash)
                next_hash += 1
        assert pool.num_evictable_blocks == recount(pool)


def test_the_engine_publishes_it(tiny_folder):
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_folder), num_blocks=64, block_size=4)
    assert llm.engine.stats()["evictable_blocks"] == 0
    llm.generate(list(range(1, 41)), SamplingParams(max_tokens=4, temperature=0))
    stats = llm.engine.stats()
    # The prompt's ten full blocks (and the full ones of its answer) stay cached, all free.
    assert stats["evictable_blocks"] >= 10
    assert stats["evictable_blocks"] == recount(llm.engine.pool) <= stats["free_blocks"]
