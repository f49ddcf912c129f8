"""Prefix-index lookup latency against the real Redis (router/index.py's Lua script).

    .venv/bin/python bench/index.py [--redis-url redis://127.0.0.1:6379/0]

For prompts of 128, 1k and 8k blocks and 4, 32 and 128 live workers, with 1M block hashes stored
in all: worker i holds the first (i+1)/W of the prompt's chain (so every worker's leading match
differs) plus random filler up to its share of the 1M. Reports p50/p99 of one `match()` call
(one EVALSHA round trip) for both searches (`exact`: chunked SMISMEMBER, stops at the first
miss; `gallop`: O(log matched) probes) and Redis memory per stored block. Writes bench/results/index.json.
Keys live under the namespace `bench-index-*` and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from common.hashing import BlockHasher, hash_member  # noqa: E402
from common.registry import RedisKeys  # noqa: E402
from router.index import RedisPrefixIndex  # noqa: E402

TOTAL_BLOCKS = 1_000_000


async def load(redis, keys: RedisKeys, workers: list[str], chain: list[int], rng: random.Random) -> None:
    share = TOTAL_BLOCKS // len(workers)
    for i, w in enumerate(workers):
        held = chain[: max(1, len(chain) * (i + 1) // len(workers))]
        members = [hash_member(h) for h in held]
        members += [hash_member(rng.getrandbits(64)) for _ in range(max(share - len(held), 0))]
        pipe = redis.pipeline(transaction=False)
        for j in range(0, len(members), 20_000):
            pipe.sadd(keys.blocks(w), *members[j : j + 20_000])
        await pipe.execute()


async def bench_case(redis, num_blocks: int, num_workers: int, queries: int) -> dict:
    out = {}
    for search in ("exact", "gallop"):
        out[search] = await _bench_case(redis, num_blocks, num_workers, queries, search)
    return {"blocks": num_blocks, "workers": num_workers, **out,
            "bytes_per_block": out["exact"].pop("bytes_per_block")}


async def _bench_case(redis, num_blocks, num_workers, queries, search) -> dict:
    keys = RedisKeys(f"bench-index-{uuid.uuid4().hex[:6]}")
    rng = random.Random(num_blocks * 1000 + num_workers)
    chain = BlockHasher("bench", 16)([rng.randrange(49152) for _ in range(num_blocks * 16)])
    workers = [f"w{i}" for i in range(num_workers)]
    before = (await redis.info("memory"))["used_memory"]
    await load(redis, keys, workers, chain, rng)
    after = (await redis.info("memory"))["used_memory"]
    index = RedisPrefixIndex(redis, keys, search)
    for _ in range(5):
        await index.match(chain, workers)
    times = []
    for _ in range(queries):
        t = time.perf_counter()
        counts = await index.match(chain, workers)
        times.append(time.perf_counter() - t)
    times.sort()
    for w in workers:
        await redis.delete(keys.blocks(w))
    expected = [max(1, num_blocks * (i + 1) // num_workers) for i in range(num_workers)]
    assert [counts[w] for w in workers] == expected  # both searches find every leading match
    return {"p50_ms": statistics.median(times) * 1e3, "p99_ms": times[int(len(times) * 0.99) - 1] * 1e3,
            "bytes_per_block": (after - before) / TOTAL_BLOCKS}


async def main_async(args) -> dict:
    redis = aioredis.from_url(args.redis_url)
    results = []
    for num_blocks in (128, 1024, 8192):
        for num_workers in (4, 32, 128):
            queries = 200 if num_blocks * num_workers <= 1024 * 32 else 30
            r = await bench_case(redis, num_blocks, num_workers, queries)
            print(json.dumps(r), file=sys.stderr)
            results.append(r)
    await redis.aclose()
    return {"total_blocks_stored": TOTAL_BLOCKS, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "index.json"))
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
