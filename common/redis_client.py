"""One way to open Redis for every service: a single server or a Redis Cluster (`--redis-cluster`).

With a cluster, `url` names any one node; the client learns the others and the slot map from it,
follows MOVED/ASK redirections, and re-learns the map after a failover. Callers keep to what both
clients share: single-key commands, scripts whose keys share a slot (`slot_groups`), pipelines
(a cluster splits them per node; a transaction must stay in one slot), and SCAN over every primary.
"""

from __future__ import annotations

from collections import defaultdict

from redis.crc import key_slot


def connect(url: str, cluster: bool = False, timeout_s: float = 1.0):
    """An asyncio client for `url`: `redis.asyncio.Redis`, or `RedisCluster` when `cluster`."""
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        # Partial coverage: while a failed master's replica takes over, the other slots still
        # answer. A command on the failed slots fails after the client's retries (and the slot
        # map is re-read); callers fail open or retry on their own schedule.
        return RedisCluster.from_url(url, socket_timeout=timeout_s,
                                     socket_connect_timeout=timeout_s, require_full_coverage=False)
    import redis.asyncio as aioredis

    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def slot_groups(keys: list[str]) -> dict[int, list[int]]:
    """Positions of `keys` grouped by cluster slot: a script may touch only one slot per call."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        groups[key_slot(key.encode())].append(i)
    return groups
