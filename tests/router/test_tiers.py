"""KV tiers in the router's index: the replica's per-tier sets and tiered matches, a replica
catching up on tier moves through a real Redis written by a real WorkerPublisher (tailing the
stream, and joining late from the per-tier sets), and every index agreeing on the answer."""

import asyncio
import contextlib
import random
import uuid

import pytest
import redis.asyncio as aioredis

from common.block_events import MEDIA, BlockEvent
from common.publisher import WorkerPublisher, by_media
from common.registry import EVENT_SHARDS, RedisKeys
from router.index import MemoryPrefixIndex, RedisPrefixIndex, ReplicaPrefixIndex
from router.replica import BlockReplica
from router.replica_feed import ReplicaFeed
from router.speculative import SpeculativeIndex
from router.tiered_match import MatchByMedium, leading_by_medium
from testing.redis_server import REDIS_URL

# ---- the replica -------------------------------------------------------------------------------


def test_a_move_down_a_tier_keeps_the_block_held():
    r = BlockReplica()
    r.add("w", [1, 2, 3, 4])
    r.add("w", [3, 4], "host")  # offloaded...
    r.remove("w", [3, 4])  # ... then evicted from the device
    assert r.match([1, 2, 3, 4], ["w"]) == {"w": 2}  # `match`: the device only
    assert r.match_by_medium([1, 2, 3, 4], ["w"]) == {"w": MatchByMedium(2, 2, 0)}
    r.add("w", [4], "disk")
    r.remove("w", [4], "host")
    assert r.match_by_medium([1, 2, 3, 4, 5], ["w"]) == {"w": MatchByMedium(2, 1, 1)}
    r.add("w", [3])  # reloaded: the device counts first, whatever else holds it
    assert r.match_by_medium([1, 2, 3, 4], ["w"]) == {"w": MatchByMedium(3, 0, 1)}
    # A run may mix tiers in any order; it stops at the first block no tier holds.
    r.add("w", [6], "host")
    assert r.match_by_medium([4, 1, 6, 2, 9, 3], ["w"]) == {"w": MatchByMedium(2, 1, 1)}
    assert r.num_blocks("w", "host") == 2 and r.held("w", "disk") == {4}
    assert r.num_entries() == 6  # device 1, 2, 3; host 3, 6; disk 4
    r.clear("w")  # `cleared`: every tier
    assert r.match_by_medium([1, 2, 3, 4], ["w"]) == {"w": MatchByMedium()}
    assert r.num_entries() == 0 and r.held("w", "host") == set()


def test_tiered_searches_agree_on_prefix_shaped_runs_and_name_only_named_workers():
    rng = random.Random(5)
    r = BlockReplica()
    chain = [rng.getrandbits(64) for _ in range(200)]
    want = {}
    for i in range(70):  # more workers than a 64-bit word
        d, h, k = sorted(rng.randrange(0, 201) for _ in range(3))
        w = f"w{i}"
        r.add(w, chain[:d])
        r.add(w, chain[d:h] + chain[:d // 2], "host")  # some device blocks on the host too
        r.add(w, chain[h:k], "disk")
        want[w] = MatchByMedium(d, h - d, k - h)
    r.add("plain", chain[:50])
    want["plain"] = MatchByMedium(50)
    ids = [*want, "ghost"]
    for search in ("exact", "gallop"):
        got = r.match_by_medium(chain, ids, search)
        assert got == {**want, "ghost": MatchByMedium()}
        assert r.match(chain, ids, search) == {w: m.device for w, m in got.items()}
    assert leading_by_medium(chain, {m: set(r.held("w7", m)) for m in MEDIA}) == want["w7"]
    # A hole: the exact walk stops at it; a gallop may count past it, never counting the hole.
    r.add("holey", chain[:3], "host")
    r.add("holey", chain[4:9], "disk")
    assert r.match_by_medium(chain, ["holey"], "exact") == {"holey": MatchByMedium(0, 3, 0)}
    galloped = r.match_by_medium(chain, ["holey"], "gallop")["holey"]
    assert galloped.host == 3 and galloped.total in (3, 8)
    with pytest.raises(ValueError, match="unknown index search"):
        r.match_by_medium(chain, ["w1"], "fuzzy")


def test_a_workers_tiers_go_with_it_and_its_bit_is_recycled_clean():
    r = BlockReplica()
    r.add("a", [1], "host")
    r.add("a", [2], "disk")
    r.drop("a")
    r.add("b", [9])  # takes a's bit: must not inherit a's tiers
    assert r.match_by_medium([1, 2], ["a", "b"]) == {"a": MatchByMedium(), "b": MatchByMedium()}
    assert r.num_entries() == 1 and r.memory_bytes() > 0


def test_a_snapshot_is_every_tier_or_the_device_alone():
    assert by_media([3, 4]) == {"device": [3, 4], "host": [], "disk": []}
    assert by_media({"host": [5]}) == {"device": [], "host": [5], "disk": []}
    with pytest.raises(ValueError, match="unknown media"):
        by_media({"gpu": [1]})


# ---- against a real Redis, written by the worker's own publisher -------------------------------


class TieredPool:
    """What a tiered worker's cache holds, per tier: the publisher's snapshot."""

    def __init__(self, held: dict[str, list[int]]) -> None:
        self.held = {m: list(held.get(m, ())) for m in MEDIA}

    async def snapshot(self) -> dict[str, list[int]]:
        return {m: list(h) for m, h in self.held.items()}

    def emit(self, pub: WorkerPublisher, kind: str, medium: str, hashes=()) -> None:
        if kind == "stored":
            self.held[medium] += [h for h in hashes if h not in self.held[medium]]
        elif kind == "removed":
            self.held[medium] = [h for h in self.held[medium] if h not in hashes]
        pub.on_events([BlockEvent(kind, tuple(hashes), medium)])  # type: ignore[arg-type]


def _state(replica: BlockReplica, wid: str) -> dict[str, set[int]]:
    return {m: replica.held(wid, m) for m in MEDIA}


async def _converge(feed: ReplicaFeed, wid: str, pool: TieredPool, rounds: int = 100) -> None:
    want = {m: set(h) for m, h in pool.held.items()}
    for _ in range(rounds):
        await asyncio.sleep(0.02)
        await feed.poll()
        if _state(feed.replica, wid) == want:
            return
    raise AssertionError(f"replica has {_state(feed.replica, wid)}, want {want}")


async def _events(redis, keys, wid):
    return {wid: (await redis.hget(keys.worker(wid), "events") or b"").decode()}


@contextlib.asynccontextmanager
async def _tiered_worker(wid: str, pool: TieredPool):
    keys = RedisKeys(f"tiers-{uuid.uuid4().hex[:6]}")
    redis = aioredis.from_url(REDIS_URL)
    pub = WorkerPublisher(REDIS_URL, keys, wid, {"role": "decode", "url": "http://127.0.0.1:1"},
                          snapshot=pool.snapshot, load=dict, ttl_s=5, flush_interval_s=0.01)
    pub.start()
    try:
        for _ in range(200):
            if pub.connected:
                break
            await asyncio.sleep(0.01)
        yield keys, redis, pub
    finally:
        await pub.close()
        for shard in range(EVENT_SHARDS):
            await redis.delete(keys.events(shard))
        await redis.aclose()


@pytest.mark.redis
def test_a_replica_catches_up_on_tier_moves_and_a_late_one_agrees():
    async def go():
        pool = TieredPool({"device": [1, 2, 3, 4, 5, 6], "host": [7]})
        async with _tiered_worker("decode-t", pool) as (keys, redis, pub):
            tail = ReplicaFeed(redis, keys, BlockReplica())
            tail.track(await _events(redis, keys, "decode-t"))
            await _converge(tail, "decode-t", pool)  # read in full from the per-tier sets
            assert tail.num_snapshots == 1
            # Offload 4..6 to the host, evict them from the device, spill 6 and 7 to disk.
            pool.emit(pub, "stored", "host", [4, 5, 6])
            pool.emit(pub, "removed", "device", [4, 5, 6])
            pool.emit(pub, "stored", "disk", [6, 7])
            pool.emit(pub, "removed", "host", [6, 7])
            await _converge(tail, "decode-t", pool)
            assert tail.num_snapshots == 1 and tail.num_gaps == 0  # entry by entry
            chain = [1, 2, 3, 4, 5, 6, 7, 8]
            assert tail.replica.match_by_medium(chain, ["decode-t"]) == {
                "decode-t": MatchByMedium(3, 2, 2)}
            # A router that joins now reads the per-tier sets and agrees with the one that
            # tailed the stream.
            late = ReplicaFeed(redis, keys, BlockReplica())
            late.track(await _events(redis, keys, "decode-t"))
            await _converge(late, "decode-t", pool)
            assert _state(late.replica, "decode-t") == _state(tail.replica, "decode-t")
            # `cleared` empties every tier, in Redis too.
            pool.held = {m: [] for m in MEDIA}
            pub.on_events([BlockEvent("cleared")])
            await _converge(tail, "decode-t", pool)
            for key in keys.block_sets("decode-t"):
                assert await redis.scard(key) == 0

    asyncio.run(go())


@pytest.mark.redis
@pytest.mark.parametrize("search", ["exact", "gallop"])
def test_every_index_agrees_on_tiered_matches(search):
    chain = list(range(100, 140))
    held = {"a": {"device": chain[:10], "host": chain[10:25], "disk": chain[25:30]},
            "b": {"host": chain[:5], "disk": chain[5:40]},
            "c": {"device": chain[:40]},
            "d": {"disk": chain[:8]}}
    want = {"a": MatchByMedium(10, 15, 5), "b": MatchByMedium(0, 5, 35),
            "c": MatchByMedium(40), "d": MatchByMedium(0, 0, 8), "ghost": MatchByMedium()}

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            workers = {}
            for wid, tiers in held.items():
                pool = TieredPool(tiers)
                keys_w, redis_w, _ = await stack.enter_async_context(_tiered_worker(wid, pool))
                workers[wid] = (keys_w, redis_w, pool)
            for wid, (keys, redis, pool) in workers.items():
                replica = ReplicaPrefixIndex(redis, keys, search)
                replica.track(await _events(redis, keys, wid))
                await _converge(replica.feed, wid, pool)
                on_redis = RedisPrefixIndex(redis, keys, search)
                ids = [wid, "ghost"]
                got = await replica.match_by_medium(chain, ids)
                assert got == {wid: want[wid], "ghost": MatchByMedium()}
                assert await on_redis.match_by_medium(chain, ids) == got
                assert await on_redis.match(chain, ids) == await replica.match(chain, ids)
                assert (await on_redis.match_by_medium(chain[:12], [wid]))[wid].total == min(
                    12, want[wid].total)
                assert await on_redis.match_by_medium([], [wid]) == {wid: MatchByMedium()}
        # The indexes that learn from routing know of no tier: their every block is a device one.
        for idx in (MemoryPrefixIndex(), SpeculativeIndex()):
            idx.record("w", chain[:7])
            assert await idx.match_by_medium(chain, ["w", "x"]) == {
                "w": MatchByMedium(7), "x": MatchByMedium()}

    asyncio.run(go())
