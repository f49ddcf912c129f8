"""Tandem on a real Redis Cluster (six local `redis-server --cluster-enabled yes` nodes: three
masters, three replicas): registry, block sets, event streams, rate limits and both index
backends work across slots; a master killed under load fails no request, and once its replica
has taken over the index converges (a router started afterwards reads every worker's set from
the cluster and routes repeated prompts to the worker that holds them)."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid

import httpx
import pytest

from common.hashing import hash_member
from common.redis_client import connect
from common.registry import RedisKeys
from router.index import RedisPrefixIndex, ReplicaPrefixIndex
from testing.cluster import Router, Worker
from testing.redis_cluster import LocalRedisCluster
from testing.streaming_load import StreamingLoad

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server not installed")]


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    c = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    yield c
    c.close()


def test_both_indexes_answer_across_slots(redis_cluster):
    async def go():
        r = connect(redis_cluster.url, cluster=True)
        keys = RedisKeys(f"slots-{uuid.uuid4().hex[:6]}")
        chain = list(range(1, 41))
        workers = [f"decode-{i}" for i in range(24)]  # spread over the 16 shards and 3 masters
        assert len({keys.event_shard(w) for w in workers}) > 8
        try:
            for i, w in enumerate(workers):
                await r.sadd(keys.blocks(w), *[hash_member(h) for h in chain[: i + 1]])
            want = {w: i + 1 for i, w in enumerate(workers)} | {"ghost": 0}
            lua = RedisPrefixIndex(r, keys, "exact", cluster=True)
            assert await lua.match(chain, [*workers, "ghost"]) == want
            replica = ReplicaPrefixIndex(r, keys, "gallop", cluster=True)
            replica.track(dict.fromkeys(workers, ""))
            await replica.feed.poll()
            assert await replica.match(chain, [*workers, "ghost"]) == want
            # KV tiers: each worker's host and disk sets continue its device run, in its slot.
            for i, w in enumerate(workers):
                await r.sadd(keys.blocks(w, "host"), *[hash_member(h) for h in chain[i + 1:i + 3]])
                await r.sadd(keys.blocks(w, "disk"), *[hash_member(h) for h in chain[i + 3:i + 4]])
            tiered = {w: (i + 1, len(chain[i + 1:i + 3]), len(chain[i + 3:i + 4]))
                      for i, w in enumerate(workers)} | {"ghost": (0, 0, 0)}
            got = await lua.match_by_medium(chain, [*workers, "ghost"])
            assert {w: (m.device, m.host, m.disk) for w, m in got.items()} == tiered
            replica.feed.resync_all()
            await replica.feed.poll()
            assert await replica.match_by_medium(chain, [*workers, "ghost"]) == got
        finally:
            for w in workers:
                await r.delete(*keys.block_sets(w))
            await r.aclose()

    asyncio.run(go())


def _cached(router: Router, prompt: str) -> int:
    r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                   json={"model": "tiny-random", "prompt": prompt, "max_tokens": 2,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_master_failover_under_load_fails_no_request_and_the_index_converges(
        redis_cluster, tiny_folder, tmp_path):
    ns = f"rc-{uuid.uuid4().hex[:6]}"
    args = ["--redis-url", redis_cluster.url, "--redis-cluster", "--namespace", ns]
    workers = [Worker(role, str(tiny_folder), cache_dir=tmp_path, extra=args, ttl=3.0)
               for role in ("prefill", "prefill", "decode", "decode")]
    routers = []
    try:
        routers.append(Router(tiny_folder, ns, cache_dir=tmp_path, redis_url=redis_cluster.url,
                              extra=["--redis-cluster", "--rate-limit-rpm", "100000"]))
        routers[0].wait_workers(4)
        load = StreamingLoad(routers[0].url, "tiny-random", num_clients=3).start()
        time.sleep(2)
        # The master that holds the first prefill worker's block set and event stream.
        victim = redis_cluster.master_of(RedisKeys(ns).blocks(workers[0].worker_id))
        redis_cluster.kill(victim)
        redis_cluster.wait_ok(30)  # its replica took over its slots
        assert f":{victim}/" not in redis_cluster.url  # new clients start from a live node
        time.sleep(3)
        result = load.stop()
        assert result["failures"] == [] and result["mismatches"] == []
        assert result["ok"] >= 10

        # A router started now knows only what the cluster holds: it must find every prompt's
        # blocks where they are. Each prompt goes first through the old router, then the new.
        routers.append(Router(tiny_folder, ns, cache_dir=tmp_path, redis_url=redis_cluster.url,
                              extra=["--redis-cluster"]))
        routers[1].wait_workers(4)
        prompts = [f"{i}{i} after the failover: prompt {i} repeats its words " * 3
                   for i in range(6)]
        for p in prompts:
            assert _cached(routers[0], p) == 0
        time.sleep(1.0)  # the workers' events reach the cluster and the new router's replica
        hits = [_cached(routers[1], p) for p in prompts]
        assert all(h > 0 for h in hits), hits
    finally:
        for p in [*routers, *workers]:
            p.close()
