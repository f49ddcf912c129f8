"""Prefix-index lookup latency, every backend against the same real Redis data (router/index.py).

    .venv/bin/python bench/index.py [--redis-url redis://127.0.0.1:6379/0] [--cluster]

`--cluster` starts a local six-node Redis Cluster (testing/redis_cluster.py) and runs there.
For prompts of 128, 1k and 8k blocks and 32 to 256 live workers, with 1M (block, worker) entries
stored in all: worker i holds the first (i+1)/W of the prompt's chain (so every worker's leading
match differs: the worst case for a search) plus random filler up to its share of the 1M.

Backends and searches, p50/p99 of one `match()` over all workers:
- `redis_exact`, `redis_gallop`: one EVALSHA per lookup (one per shard slot on a cluster);
- `replica_exact`, `replica_gallop`: the router's in-process replica (router/replica.py), built
  the way a router builds it: the feed reads every worker's set from Redis (`snapshot_s`).
Memory per stored entry: Redis `used_memory` delta, and the replica's own estimate.
Writes bench/results/index[-cluster].json. Keys live under `bench-index-*` and are deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from common.hashing import hash_member  # noqa: E402
from common.redis_client import connect  # noqa: E402
from common.registry import RedisKeys  # noqa: E402
from router.index import RedisPrefixIndex, ReplicaPrefixIndex  # noqa: E402

TOTAL_ENTRIES = 1_000_000
CASES = [(128, 32), (1024, 32), (1024, 128), (8192, 32), (8192, 256)]
GOALS_P99_MS = {(128, 32): 0.3, (8192, 256): 1.0}  # issue 19


async def used_memory(redis, cluster: bool) -> int:
    if cluster:  # every primary's, summed (replicas hold copies)
        from redis.asyncio.cluster import RedisCluster

        info = await redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(v["used_memory"]) for v in info.values())
    return int((await redis.info("memory"))["used_memory"])


async def load(redis, keys: RedisKeys, workers: list[str], chain: list[int],
               rng: random.Random) -> None:
    share = TOTAL_ENTRIES // len(workers)
    for i, w in enumerate(workers):
        held = chain[: max(1, len(chain) * (i + 1) // len(workers))]
        members = [hash_member(h) for h in held]
        members += [hash_member(rng.getrandbits(64)) for _ in range(max(share - len(held), 0))]
        pipe = redis.pipeline(transaction=False)
        for j in range(0, len(members), 20_000):
            pipe.sadd(keys.blocks(w), *members[j : j + 20_000])
        await pipe.execute()


async def timed(index, chain, workers, queries) -> tuple[dict, dict]:
    for _ in range(5):
        await index.match(chain, workers)
    times = []
    for _ in range(queries):
        t = time.perf_counter()
        counts = await index.match(chain, workers)
        times.append(time.perf_counter() - t)
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    return {"p50_ms": statistics.median(times) * 1e3, "p99_ms": p99 * 1e3}, counts


async def bench_case(redis, cluster: bool, num_blocks: int, num_workers: int) -> dict:
    keys = RedisKeys(f"bench-index-{uuid.uuid4().hex[:6]}")
    rng = random.Random(num_blocks * 1000 + num_workers)
    chain = [rng.getrandbits(64) for _ in range(num_blocks)]
    workers = [f"w{i}" for i in range(num_workers)]
    expected = {w: max(1, num_blocks * (i + 1) // num_workers) for i, w in enumerate(workers)}
    before = await used_memory(redis, cluster)
    await load(redis, keys, workers, chain, rng)
    out: dict = {"blocks": num_blocks, "workers": num_workers,
                 "redis_bytes_per_entry": (await used_memory(redis, cluster) - before)
                                          / TOTAL_ENTRIES}
    try:
        lua_queries = 200 if num_blocks * num_workers <= 1024 * 32 else 40
        for search in ("exact", "gallop"):
            stats, counts = await timed(RedisPrefixIndex(redis, keys, search, cluster), chain,
                                        workers, lua_queries)
            assert counts == expected, f"redis {search} miscounted"
            out[f"redis_{search}"] = stats
        replica = ReplicaPrefixIndex(redis, keys, "gallop", cluster)
        replica.track(dict.fromkeys(workers, ""))
        t = time.perf_counter()
        while replica.feed._stale:
            await replica.feed.poll()
        out["replica_snapshot_s"] = time.perf_counter() - t
        out["replica_bytes_per_entry"] = (replica.replica.memory_bytes()
                                          / replica.replica.num_entries())
        for search in ("exact", "gallop"):
            replica.search = search
            stats, counts = await timed(replica, chain, workers, 500)
            assert counts == expected, f"replica {search} miscounted"
            out[f"replica_{search}"] = stats
        goal = GOALS_P99_MS.get((num_blocks, num_workers))
        if goal is not None:
            out["goal_p99_ms"] = goal
            out["goal_met"] = out["replica_gallop"]["p99_ms"] < goal
    finally:
        pipe = redis.pipeline(transaction=False)
        for w in workers:
            pipe.delete(keys.blocks(w))
        await pipe.execute()
    return out


async def main_async(args) -> dict:
    cluster = None
    url = args.redis_url
    if args.cluster:
        from testing.redis_cluster import LocalRedisCluster

        cluster = LocalRedisCluster(Path(tempfile.mkdtemp(prefix="bench-index-")))
        url = cluster.url
    redis = connect(url, cluster=bool(cluster), timeout_s=30.0)
    results = []
    try:
        for num_blocks, num_workers in CASES:
            r = await bench_case(redis, bool(cluster), num_blocks, num_workers)
            print(json.dumps(r), file=sys.stderr)
            results.append(r)
    finally:
        await redis.aclose()
        if cluster is not None:
            cluster.close()
    return {"total_entries_stored": TOTAL_ENTRIES,
            "redis": "cluster (3 masters)" if cluster else url, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--cluster", action="store_true",
                    help="start a local Redis Cluster and run there")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    out = Path(args.out or ROOT / "bench" / "results"
               / f"index{'-cluster' if args.cluster else ''}.json")
    write_result(out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
