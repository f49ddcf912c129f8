"""The router's replica index: the wire format and key layout (golden), the replica's searches,
and the feed against a real Redis written by a real WorkerPublisher: convergence, gaps, resets,
leavers, poison."""

import asyncio
import contextlib
import random
import uuid

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from common.background import BackgroundErrors
from common.block_events import BlockEvent, StreamEntry
from common.publisher import WorkerPublisher
from common.registry import EVENT_SHARDS, RedisKeys
from router.replica import BlockReplica
from router.replica_feed import ReplicaFeed
from testing.redis_server import REDIS_URL

# ---- golden: what workers and routers of different versions must agree on ----------------------


def test_key_layout_and_shards_are_pinned():
    keys = RedisKeys("prod")
    assert EVENT_SHARDS == 16
    assert keys.worker("decode-10.0.0.5-8300") == "tandem:prod:worker:{decode-10.0.0.5-8300}"
    assert keys.event_shard("decode-10.0.0.5-8300") == 11
    assert (keys.blocks("decode-10.0.0.5-8300")
            == "tandem:prod:blocks:{prod#11}:decode-10.0.0.5-8300")
    assert keys.events(11) == "tandem:prod:events:{prod#11}"
    assert keys.worker_id_of(b"tandem:prod:worker:{decode-10.0.0.5-8300}") == "decode-10.0.0.5-8300"


def test_stream_entry_wire_format_is_pinned():
    e = StreamEntry("prefill-a", "0123456789abcdef", 7, "stored", (1, (1 << 64) - 1))
    fields = e.fields()
    assert fields == {"w": b"prefill-a", "e": b"0123456789abcdef", "s": b"7", "k": b"stored",
                      "h": b"\x01" + b"\x00" * 7 + b"\xff" * 8}
    assert StreamEntry.parse({k.encode(): v for k, v in fields.items()}) == e


def test_stream_entry_medium_is_pinned():
    """A device entry is written without `m` (byte-identical to a worker's before tiers), the
    lower tiers with it; an entry without `m` (an older worker) or with `m` = device is a
    device entry."""
    base = {b"w": b"decode-a", b"e": b"0123456789abcdef", b"s": b"3", b"k": b"stored",
            b"h": b"\x2a" + b"\x00" * 7}
    assert StreamEntry.parse(base) == StreamEntry("decode-a", "0123456789abcdef", 3, "stored",
                                                  (42,), "device")
    assert StreamEntry.parse({**base, b"m": b"device"}).medium == "device"
    for medium in ("host", "disk"):
        e = StreamEntry("decode-a", "0123456789abcdef", 3, "stored", (42,), medium)
        assert e.fields() == {"w": b"decode-a", "e": b"0123456789abcdef", "s": b"3",
                              "k": b"stored", "h": b"\x2a" + b"\x00" * 7,
                              "m": medium.encode()}
        assert StreamEntry.parse({**base, b"m": medium.encode()}) == e
    device = StreamEntry("decode-a", "0123456789abcdef", 3, "removed", (42,))
    assert "m" not in device.fields()
    assert BlockEvent("stored", (1,)).medium == "device"
    for bad in (b"", b"Host", b"gpu", b"cpu", b"device ", b"x" * 5000):
        with pytest.raises(ValueError, match="bad medium"):
            StreamEntry.parse({**base, b"m": bad})


def test_tier_keys_are_pinned():
    keys = RedisKeys("prod")
    assert keys.block_sets("decode-10.0.0.5-8300") == [
        "tandem:prod:blocks:{prod#11}:decode-10.0.0.5-8300",
        "tandem:prod:blocks-host:{prod#11}:decode-10.0.0.5-8300",
        "tandem:prod:blocks-disk:{prod#11}:decode-10.0.0.5-8300"]
    with pytest.raises(ValueError, match="unknown medium"):
        keys.blocks("decode-10.0.0.5-8300", "tape")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    {b"w": b"x{y}", b"e": b"0123456789abcdef", b"s": b"1", b"k": b"stored"},
    {b"w": b"x", b"e": b"nothex", b"s": b"1", b"k": b"stored"},
    {b"w": b"x", b"e": b"0123456789abcdef", b"s": b"-1", b"k": b"stored"},
    {b"w": b"x", b"e": b"0123456789abcdef", b"s": b"1", b"k": b"exploded"},
    {b"w": b"x", b"e": b"0123456789abcdef", b"s": b"1", b"k": b"stored", b"h": b"\x00" * 9},
    {b"w": b"x", b"e": b"0123456789abcdef", b"s": b"9" * 30, b"k": b"stored"},
])
def test_malformed_entries_are_refused(bad):
    with pytest.raises(ValueError):
        StreamEntry.parse(bad)


# ---- the replica -------------------------------------------------------------------------------


def test_searches_agree_on_prefix_shaped_sets_and_count_only_named_workers():
    rng = random.Random(3)
    r = BlockReplica()
    chain = [rng.getrandbits(64) for _ in range(300)]
    held = {f"w{i}": rng.randrange(0, 301) for i in range(70)}  # more workers than a 64-bit word
    for w, n in held.items():
        r.add(w, chain[:n] + [rng.getrandbits(64) for _ in range(5)])
    ids = list(held) + ["ghost"]
    for n in (0, 1, 2, 17, 300):
        want = {w: min(k, n) for w, k in held.items()} | {"ghost": 0}
        assert r.match(chain[:n], ids, "exact") == want
        assert r.match(chain[:n], ids, "gallop") == want
    assert r.match(chain, ["w3"]) == {"w3": held["w3"]}
    with pytest.raises(ValueError, match="unknown index search"):
        r.match(chain, ["w1"], "fuzzy")


def test_exact_stops_at_a_hole_and_gallop_may_overcount():
    r = BlockReplica()
    chain = list(range(1, 9))
    r.add("holey", chain[:3] + chain[4:])
    assert r.match(chain, ["holey"], "exact") == {"holey": 3}
    assert r.match(chain, ["holey"], "gallop")["holey"] >= 3


def test_drop_frees_entries_and_recycles_the_bit():
    r = BlockReplica()
    r.add("a", [1, 2, 3])
    r.add("b", [1, 2])
    r.drop("a")
    assert r.match([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 2}
    assert set(r.holders) == {1, 2} and r.num_entries() == 2
    r.add("c", [1, 2, 3])  # takes a's bit: must not inherit a's blocks
    assert r.match([1, 2, 3], ["b", "c"]) == {"b": 2, "c": 3}
    r.remove("c", [3])
    r.clear("b")
    assert r.match([1, 2, 3], ["b", "c"]) == {"b": 0, "c": 2}
    r.replace("b", [1])
    assert r.match([1, 2, 3], ["b", "c"]) == {"b": 1, "c": 2}
    assert r.memory_bytes() > 0


# ---- the feed against a real Redis, written by the worker's own publisher ----------------------

class FakePool:
    """What a worker's block pool holds: the publisher's snapshot."""

    def __init__(self):
        self.held: list[int] = []

    async def snapshot(self) -> list[int]:
        return list(self.held)


async def _publisher(keys, wid, pool) -> WorkerPublisher:
    pub = WorkerPublisher(REDIS_URL, keys, wid, {"role": "decode", "url": "http://127.0.0.1:1"},
                          snapshot=pool.snapshot, load=dict, ttl_s=5, flush_interval_s=0.01)
    pub.start()
    for _ in range(200):
        if pub.connected:
            return pub
        await asyncio.sleep(0.01)
    raise TimeoutError("publisher did not connect")


def _emit(pub, pool, kind, hashes=()):
    if kind == "stored":
        pool.held += list(hashes)
    elif kind == "removed":
        pool.held = [h for h in pool.held if h not in hashes]
    pub.on_events([BlockEvent(kind, tuple(hashes))])


async def _converge(feed, wid, want, rounds=100):
    for _ in range(rounds):
        await asyncio.sleep(0.02)
        await feed.poll()
        if feed.replica._held.get(wid, set()) == set(want):
            return
    raise AssertionError(f"replica has {sorted(feed.replica._held.get(wid, ()))}, "
                         f"want {sorted(want)}")


async def _events(redis, keys, wid):
    return {wid: (await redis.hget(keys.worker(wid), "events") or b"").decode()}


@contextlib.asynccontextmanager
async def _harness(wid: str, held=(), errors=None):
    """A real publisher for worker `wid` (holding `held`) and a feed, in a fresh namespace; the
    feed tracks the worker and has read its set."""
    keys = RedisKeys(f"feed-{uuid.uuid4().hex[:6]}")
    redis = aioredis.from_url(REDIS_URL)
    pool = FakePool()
    pool.held = list(held)
    pub = await _publisher(keys, wid, pool)
    feed = ReplicaFeed(redis, keys, BlockReplica(), errors)
    try:
        feed.track(await _events(redis, keys, wid))
        await _converge(feed, wid, held)
        yield keys, redis, pool, pub, feed
    finally:
        await pub.close()
        for shard in range(EVENT_SHARDS):
            await redis.delete(keys.events(shard))
        await redis.aclose()


@pytest.mark.redis
def test_feed_follows_a_publisher_through_gaps_resets_and_leaving():
    async def go():
        async with _harness("decode-a", [1, 2, 3]) as (keys, redis, pool, pub, feed):
            # Read in full when first seen (the harness waited for it).
            assert feed.num_snapshots == 1
            _emit(pub, pool, "stored", [4, 5])
            _emit(pub, pool, "removed", [1])
            await _converge(feed, "decode-a", [2, 3, 4, 5])  # then entry by entry
            assert feed.num_snapshots == 1 and feed.num_gaps == 0

            # An entry lost (trimmed, failover): the next one shows the gap; the set is re-read.
            stream = keys.events(keys.event_shard("decode-a"))
            _emit(pub, pool, "stored", [6])
            await asyncio.sleep(0.1)
            await redis.xtrim(stream, maxlen=0)
            _emit(pub, pool, "stored", [7])
            await _converge(feed, "decode-a", [2, 3, 4, 5, 6, 7])
            assert feed.num_gaps == 1 and feed.num_snapshots == 2

            # The tail lost with nothing after it: the heartbeat names an entry never read.
            _emit(pub, pool, "stored", [8])
            await asyncio.sleep(0.1)
            await redis.xtrim(stream, maxlen=0)
            await pub._heartbeat()
            feed.track(await _events(redis, keys, "decode-a"))
            await _converge(feed, "decode-a", [2, 3, 4, 5, 6, 7, 8])
            assert feed.num_gaps == 2

            # Redis emptied: the publisher rewrites its set in a new epoch; the feed re-reads it.
            await redis.delete(keys.blocks("decode-a"))
            pub._resync = True
            await _converge(feed, "decode-a", pool.held)

            # Deregistering writes `left`: the replica drops the worker before any refresh.
            await pub.close()
            for _ in range(50):
                await feed.poll()
                if "decode-a" not in feed.replica.workers():
                    break
                await asyncio.sleep(0.02)
            assert "decode-a" not in feed.replica.workers()

    asyncio.run(go())


@pytest.mark.redis
def test_poisoned_stream_entries_are_skipped_and_the_feed_lives_on():
    async def go():
        registry = CollectorRegistry()
        async with _harness("decode-b", errors=BackgroundErrors(registry)) as (
                keys, redis, pool, pub, feed):
            stream = keys.events(keys.event_shard("decode-b"))
            await redis.xadd(stream, {"w": "decode-b", "e": "zz", "s": "1", "k": "stored"})
            await redis.xadd(stream, {"w": "decode-b", "k": "stored", "h": b"\x01" * 7})
            _emit(pub, pool, "stored", [11, 12])
            await _converge(feed, "decode-b", [11, 12])
            assert registry.get_sample_value("tandem_background_errors_total",
                                             {"task": "index_feed"}) == 2
            # A well-formed entry for a worker that is not registered changes nothing.
            forged = StreamEntry("decode-ghost", "0" * 16, 0, "stored", (99,))
            await redis.xadd(keys.events(keys.event_shard("decode-ghost")), forged.fields())
            await feed.poll()
            assert "decode-ghost" not in feed.replica.workers()

    asyncio.run(go())


def test_track_drops_workers_that_left_the_directory():
    feed = ReplicaFeed(None, RedisKeys("x"), BlockReplica())
    feed.track({"a": "", "b": ""})
    feed.replica.add("a", [1, 2])
    feed.replica.add("b", [1])
    feed.track({"b": ""})  # a's registration expired (kill -9): gone from the replica at once
    assert feed.replica.workers() == {"b"}
    assert feed.replica.match([1, 2], ["a", "b"]) == {"a": 0, "b": 1}
