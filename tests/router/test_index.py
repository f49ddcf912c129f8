"""The prefix index against the real Redis: both searches, the in-memory twin, dead workers."""

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from common.hashing import BlockHasher, hash_member
from common.registry import RedisKeys
from router.index import MemoryPrefixIndex, RedisPrefixIndex
from testing.redis_server import REDIS_URL

pytestmark = pytest.mark.redis


def run(coro):
    return asyncio.run(coro)


async def _setup(held: dict[str, list[int]]):
    r = aioredis.from_url(REDIS_URL)
    keys = RedisKeys(f"idx-{uuid.uuid4().hex[:6]}")
    for w, hashes in held.items():
        if hashes:
            await r.sadd(keys.blocks(w), *[hash_member(h) for h in hashes])
    return r, keys


@pytest.mark.parametrize("search", ["exact", "gallop"])
def test_leading_matches_per_worker(search):
    chain = BlockHasher("m", 4)(list(range(4 * 37)))  # 37 blocks

    async def go():
        held = {"a": chain[:37], "b": chain[:10], "c": chain[:1], "d": [], "e": [7, 8, 9]}
        r, keys = await _setup(held)
        try:
            idx = RedisPrefixIndex(r, keys, search)
            got = await idx.match(chain, ["a", "b", "c", "d", "e", "ghost"])
            assert got == {"a": 37, "b": 10, "c": 1, "d": 0, "e": 0, "ghost": 0}
            for n in (1, 2, 3, 5, 8, 9, 16, 17, 36):
                assert (await idx.match(chain[:n], ["b"]))["b"] == min(n, 10)
            assert await idx.match([], ["a"]) == {"a": 0}
        finally:
            for w in held:
                await r.delete(keys.blocks(w))
            await r.aclose()

    run(go())


def test_exact_stops_at_a_hole_and_gallop_may_overcount():
    chain = BlockHasher("m", 4)(list(range(4 * 8)))

    async def go():
        held = {"holey": chain[:3] + chain[4:8]}  # block 4 (index 3) evicted, later ones kept
        r, keys = await _setup(held)
        try:
            assert (await RedisPrefixIndex(r, keys, "exact").match(chain, ["holey"]))["holey"] == 3
            assert (await RedisPrefixIndex(r, keys, "gallop").match(chain, ["holey"]))["holey"] >= 3
        finally:
            await r.delete(keys.blocks("holey"))
            await r.aclose()

    run(go())


def test_memory_index_learns_from_routing():
    idx = MemoryPrefixIndex(max_blocks=4)
    chain = [1, 2, 3, 4, 5]
    idx.record("w", chain[:3])
    assert run(idx.match(chain, ["w", "x"])) == {"w": 3, "x": 0}
    idx.record("w", [9, 10])  # over capacity: the oldest entries go first
    assert run(idx.match(chain, ["w"]))["w"] == 0
    with pytest.raises(ValueError, match="unknown index search"):
        RedisPrefixIndex(aioredis.from_url(REDIS_URL), RedisKeys(), "fuzzy")


def test_directory_keeps_workers_through_a_redis_data_loss_but_drops_a_dead_one():
    """A worker whose key expires is dropped at the next refresh; when Redis itself lost its data
    (the router's own sentinel key is gone too) the known workers stay for the grace period."""
    from router.workers import WorkerDirectory

    async def go():
        r, keys = await _setup({})
        d = WorkerDirectory(keys, [], restart_grace_s=30.0)
        for w in ("w1", "w2"):
            await r.hset(keys.worker(w), mapping={"role": "decode", "url": f"http://{w}"})
        await d.refresh(r)
        assert set(d.workers) == {"w1", "w2"}
        await r.delete(keys.worker("w2"))  # w2 died: its key expired
        await d.refresh(r)
        assert set(d.workers) == {"w1"}
        await r.delete(keys.worker("w1"), d._sentinel)  # Redis restarted empty
        await d.refresh(r)
        assert set(d.workers) == {"w1"}  # kept while it re-registers
        d._grace_until = 0.0  # grace over and still absent: really gone
        await d.refresh(r)
        assert set(d.workers) == set()
        await r.delete(d._sentinel)
        await r.aclose()

    run(go())


def test_every_index_backend_has_the_whole_protocol():
    from router.index import INDEXES, PrefixIndex

    wanted = {n for n in vars(PrefixIndex) if not n.startswith("_")}
    for cls in (*INDEXES.values(), MemoryPrefixIndex):
        assert wanted <= set(dir(cls)), (cls.__name__, wanted - set(dir(cls)))
    idx = MemoryPrefixIndex()
    idx.track({"w": ""}, data_lost=True)  # no-ops, as a directory with Redis calls them
    run(idx.run(0.01))
