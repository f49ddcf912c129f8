"""The prefix index: per live worker, how many leading blocks of a prompt it already holds.

Two backends read what workers publish (common/publisher.py), named in `INDEXES`:

- `replica` (default): the router's own copy of every set, fed by the workers' event streams
  (router/replica.py, router/replica_feed.py); a lookup never leaves the process.
- `redis`: one Lua round trip per lookup over the sets in Redis (one per shard on a cluster;
  router/lookup_scripts.py); no copy in the router, every lookup ships the prompt's hashes.

`MemoryPrefixIndex` has the same `match`/`record` interface for single-router development and
learns only from the router's own decisions (and the router's approximate index of vLLM
backends, which publish nothing).

`match` counts device blocks only; `match_by_medium` counts a leading run held in any KV tier,
split by tier (router/tiered_match.py). The published indexes agree on both; the indexes that
learn from routing know of no tier and answer every block as a device block.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import redis.exceptions

from common.background import BackgroundErrors
from common.hashing import hash_member
from common.redis_client import slot_groups
from common.registry import RedisKeys
from router.lookup_scripts import SEARCHES, tiered
from router.replica import BlockReplica
from router.replica_feed import ReplicaFeed
from router.tiered_match import MatchByMedium, leading_by_medium


def _check_search(search: str) -> None:
    if search not in SEARCHES:
        raise ValueError(f"unknown index search {search!r}; choose from {', '.join(SEARCHES)}")


# What a lookup raises when Redis (or a slot of a cluster) does not answer: the index is
# unavailable and the router routes on load. Anything else (a bug, an answer it cannot read) is
# not "Redis down" (router/prefix_lookup.py).
UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError, OSError, TimeoutError)


class PrefixIndex(Protocol):
    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        """Leading matched blocks per worker id (0 for unknown workers), on the device."""

    async def match_by_medium(self, block_hashes: list[int], worker_ids: list[str]
                              ) -> dict[str, MatchByMedium]:
        """Each worker id's leading run held in any tier, split by tier (all 0: unknown)."""

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        """The router routed these blocks to `worker_id` (used by approximate backends)."""

    def track(self, workers: dict[str, str], data_lost: bool = False,
              capacities: dict[str, int] | None = None) -> None:
        """The Redis-registered workers now (id -> their registration's `events` field); with
        `data_lost`, Redis lost its data since the last call; `capacities`: each worker's
        registered number of KV blocks (what its set may hold, give or take)."""

    async def run(self, interval_s: float) -> None:
        """Keep whatever the index holds up to date (returns at once if it holds nothing)."""

    def stats(self) -> dict:
        """What it holds and how it has kept up, for /ready."""


class RedisPrefixIndex:
    def __init__(self, redis, keys: RedisKeys, search: str = "gallop", cluster: bool = False,
                 errors: BackgroundErrors | None = None) -> None:
        _check_search(search)
        self.redis = redis
        self.keys = keys
        self.cluster = cluster
        self._script = redis.register_script(SEARCHES[search])
        self._tiered = redis.register_script(tiered(search))

    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        if not block_hashes or not worker_ids:
            return dict.fromkeys(worker_ids, 0)
        answers = await self._run(self._script, block_hashes, worker_ids,
                                  lambda w: [self.keys.blocks(w)])
        return {w: int(c) for w, c in answers.items()}

    async def match_by_medium(self, block_hashes: list[int], worker_ids: list[str]
                              ) -> dict[str, MatchByMedium]:
        if not block_hashes or not worker_ids:
            return dict.fromkeys(worker_ids, MatchByMedium())
        answers = await self._run(self._tiered, block_hashes, worker_ids, self.keys.block_sets)
        return {w: MatchByMedium(*(int(n) for n in c)) for w, c in answers.items()}

    async def _run(self, script, block_hashes: list[int], worker_ids: list[str],
                   keys_of) -> dict[str, object]:
        """`script` over each worker's keys (`keys_of(worker id)`, one slot per worker): its
        answer per worker id."""
        args = [hash_member(h) for h in block_hashes]
        per_worker = [keys_of(w) for w in worker_ids]
        if not self.cluster:
            answers = await script(keys=[k for ks in per_worker for k in ks], args=args)
            return dict(zip(worker_ids, answers, strict=True))
        # A script may touch one slot: one call per shard's slot, in parallel, merged.
        groups = list(slot_groups([ks[0] for ks in per_worker]).values())
        answers = await asyncio.gather(*(
            script(keys=[k for i in g for k in per_worker[i]], args=args) for g in groups))
        out = {}
        for group, counts in zip(groups, answers, strict=True):
            for i, c in zip(group, counts, strict=True):
                out[worker_ids[i]] = c
        return out

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        pass  # workers publish what they really hold

    def track(self, workers: dict[str, str], data_lost: bool = False,
              capacities: dict[str, int] | None = None) -> None:
        pass  # nothing kept here

    async def run(self, interval_s: float) -> None:
        pass

    def stats(self) -> dict:
        return {"backend": "redis"}


class ReplicaPrefixIndex:
    """Lookups on the router's replica; `run` keeps it fed, `track` names the live workers."""

    def __init__(self, redis, keys: RedisKeys, search: str = "gallop", cluster: bool = False,
                 errors: BackgroundErrors | None = None) -> None:
        _check_search(search)
        self.search = search
        self.replica = BlockReplica()
        self.feed = ReplicaFeed(redis, keys, self.replica, errors)

    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        return self.replica.match(block_hashes, worker_ids, self.search)

    async def match_by_medium(self, block_hashes: list[int], worker_ids: list[str]
                              ) -> dict[str, MatchByMedium]:
        return self.replica.match_by_medium(block_hashes, worker_ids, self.search)

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        pass  # workers publish what they really hold

    def track(self, workers: dict[str, str], data_lost: bool = False,
              capacities: dict[str, int] | None = None) -> None:
        if data_lost:
            self.feed.resync_all()
        self.feed.track(workers, capacities)

    async def run(self, interval_s: float) -> None:
        await self.feed.run(interval_s)

    def stats(self) -> dict:
        r, f = self.replica, self.feed
        entries = r.num_entries()
        return {"backend": "replica", "workers": len(r.workers()), "entries": entries,
                "bytes_per_entry": round(r.memory_bytes() / entries, 1) if entries else None,
                "stream_entries": f.num_entries, "snapshots": f.num_snapshots, "gaps": f.num_gaps,
                "stale": len(f._stale)}


INDEXES = {"replica": ReplicaPrefixIndex, "redis": RedisPrefixIndex}


class MemoryPrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self._sets: dict[str, dict[int, None]] = {}
        self.max_blocks = max_blocks

    def stats(self) -> dict:
        return {"backend": "memory", "workers": len(self._sets)}

    def track(self, workers: dict[str, str], data_lost: bool = False,
              capacities: dict[str, int] | None = None) -> None:
        pass  # it learns from routing, not from registrations

    async def run(self, interval_s: float) -> None:
        pass

    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        return {w: leading_count(block_hashes, self._sets.get(w, {})) for w in worker_ids}

    async def match_by_medium(self, block_hashes: list[int], worker_ids: list[str]
                              ) -> dict[str, MatchByMedium]:
        """What it learned from routing: all device blocks (a routed prompt is computed)."""
        return {w: leading_by_medium(block_hashes, {"device": self._sets.get(w, {})})
                for w in worker_ids}

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        held = self._sets.setdefault(worker_id, {})
        for h in block_hashes:
            held.pop(h, None)
            held[h] = None  # most recent last
        while len(held) > self.max_blocks:
            held.pop(next(iter(held)))


def leading_count(block_hashes: list[int], held) -> int:
    """How many leading hashes of `block_hashes` are in `held` (stops at the first miss)."""
    n = 0
    for h in block_hashes:
        if h not in held:
            break
        n += 1
    return n
