"""The worker side of the Redis schema (common/registry.py): registration, heartbeat, and the
worker's block sets (one per tier: `blocks:{id}`, `blocks-host:{id}`, `blocks-disk:{id}`)
mirrored into Redis and its shard's event stream (common/block_events.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from common.background import BackgroundErrors, cancelling
from common.block_events import MAX_HASHES_PER_ENTRY, MEDIA, BlockEvent, StreamEntry
from common.hashing import hash_member
from common.redis_client import connect
from common.registry import RedisKeys, registration_signature

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0  # the most a worker's shutdown waits on each Redis step
# Entries kept per event stream (approximate trim), and how long a stream outlives its last
# write: it is a feed for live readers, not a store. A reader that falls further behind sees a
# gap in sequence numbers (or its heartbeat check does) and re-reads the set.
STREAM_MAXLEN = 100_000
STREAM_TTL_MS = 5_000

# What a snapshot returns: the device set alone (workers without tiers), or every tier's set by
# medium ("device", "host", "disk"; a medium left out holds nothing).
Snapshot = list[int] | Mapping[str, list[int]]


class WorkerPublisher:
    """Registers one worker and mirrors its cached block hashes, per tier, into Redis.

    `on_events` may be called from any thread (the engine's); everything else runs on the event
    loop. While Redis is unreachable, events are dropped and a full rewrite is owed: the set is
    rebuilt from `snapshot()` when the connection returns, so nothing is lost that matters.
    """

    def __init__(
        self,
        redis_url: str,
        keys: RedisKeys,
        worker_id: str,
        info: dict[str, Any],
        snapshot: Callable[[], Awaitable[Snapshot]],
        load: Callable[[], dict[str, Any]],
        ttl_s: float = 10.0,
        flush_interval_s: float = 0.02,
        max_pending: int = 100_000,
        errors: BackgroundErrors | None = None,
        token: str | None = None,
        cluster: bool = False,
    ) -> None:
        self.redis = connect(redis_url, cluster, timeout_s=2.0)
        self.keys = keys
        self.stream = keys.events(keys.event_shard(worker_id))
        self.epoch = secrets.token_hex(8)
        self.seq = -1  # of the last entry written in this epoch
        self.worker_id = worker_id
        self.info = info
        self._fields = {k: (json.dumps(v) if isinstance(v, dict | list) else str(v))
                        for k, v in info.items()}
        if token:
            self._fields["signature"] = registration_signature(worker_id, self._fields, token)
        self._snapshot = snapshot
        self._load = load
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self.errors = errors or BackgroundErrors()
        self._pending: list[BlockEvent] = []
        self._lock = threading.Lock()
        self._resync = True
        self.connected = False
        self.num_resyncs = 0
        self.num_dropped_events = 0
        self._task: asyncio.Task | None = None

    def on_events(self, events) -> None:
        with self._lock:
            if self._resync:
                return  # a full rewrite is owed anyway
            self._pending.extend(events)
            if len(self._pending) > self.max_pending:
                self.num_dropped_events += len(self._pending)
                self._pending.clear()
                self._resync = True

    def resync(self) -> None:
        """Owe a full rewrite: the set is rebuilt from `snapshot()` under a new epoch, so every
        reader re-reads it (a vLLM worker restarted, or its event history was lost)."""
        with self._lock:
            self._pending.clear()
            self._resync = True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"redis-publisher-{self.worker_id}")

    async def close(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            # redis-py can miss a cancellation that lands inside a pipeline's execute and wait
            # on forever; deregistering must not wait with it.
            done, _ = await asyncio.wait({self._task}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                log.warning("redis publisher did not stop within %.0f s; deregistering anyway",
                            CLOSE_TIMEOUT_S)
        if deregister:
            try:
                await asyncio.wait_for(self.redis.delete(self.keys.worker(self.worker_id),
                                                         *self.keys.block_sets(self.worker_id)),
                                       CLOSE_TIMEOUT_S)
                await asyncio.wait_for(self._send("left"), CLOSE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - best effort on shutdown
                log.warning("could not deregister %s from Redis: %s", self.worker_id, e)
        await self.redis.aclose()

    async def _run(self) -> None:
        next_beat = 0.0
        backoff = 0.2
        loop = asyncio.get_running_loop()
        while not cancelling():
            try:
                if self._resync:
                    await self._rewrite()
                now = loop.time()
                if now >= next_beat:
                    await self._heartbeat()
                    next_beat = now + self.ttl_s / 3
                await self._flush()
                if not self.connected:
                    log.info("redis: %s connected", self.worker_id)
                self.connected = True
                backoff = 0.2
                await asyncio.sleep(self.flush_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - redis errors of every kind: retry
                self.errors.record("redis_publisher", e)
                if self.connected:
                    log.warning("redis: lost connection (%s); requests continue, "
                                "index resyncs later", e)
                self.connected = False
                with self._lock:
                    self._pending.clear()
                    self._resync = True
                next_beat = 0.0
                await asyncio.sleep(backoff)
                # Never longer than a heartbeat: a worker asleep past its key's TTL when Redis
                # comes back (after a stall, say) is dropped by every router until it wakes.
                backoff = min(backoff * 2, 5.0, self.ttl_s / 3)

    async def _rewrite(self) -> None:
        with self._lock:
            self._resync = False
            self._pending.clear()
        # Events after this point queue up; the snapshot is taken on the engine thread, so the
        # set written is consistent with the events that follow it.
        by_medium = by_media(await self._snapshot())
        pipe = self.redis.pipeline(transaction=True)
        for medium in MEDIA:
            key = self.keys.blocks(self.worker_id, medium)
            pipe.delete(key)
            members = [hash_member(h) for h in by_medium[medium]]
            for i in range(0, len(members), 10_000):
                pipe.sadd(key, *members[i : i + 10_000])
            pipe.expire(key, int(self.ttl_s))
        await pipe.execute()
        # A new epoch: readers re-read the set. Written after the set, so they read the new one.
        self.epoch, self.seq = secrets.token_hex(8), -1
        await self._send("reset")
        self.num_resyncs += 1

    def _append(self, pipe, kind: str, block_hashes: tuple[int, ...] = (),
                medium: str = "device") -> None:
        """Queue the next entry of this worker's stream on `pipe`."""
        self.seq += 1
        entry = StreamEntry(self.worker_id, self.epoch, self.seq, kind,
                            block_hashes, medium)  # type: ignore[arg-type]
        pipe.xadd(self.stream, entry.fields(), maxlen=STREAM_MAXLEN, approximate=True)
        pipe.pexpire(self.stream, STREAM_TTL_MS)

    async def _send(self, kind: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._append(pipe, kind)
        await pipe.execute()

    async def _heartbeat(self) -> None:
        wkey, bkeys = self.keys.worker(self.worker_id), self.keys.block_sets(self.worker_id)
        # `events`: where this worker's stream stands, so a reader that lost the tail sees it.
        fields = {**self._fields, "load": json.dumps(self._load()),
                  "events": f"{self.epoch}:{self.seq}"}
        # The whole hash is rewritten at once (MULTI): a field someone else added (which
        # breaks the signature, so routers refuse the worker) lives one heartbeat at most.
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(wkey)
        pipe.hset(wkey, mapping=fields)
        pipe.expire(wkey, int(self.ttl_s))
        await pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        for key in bkeys:
            pipe.expire(key, int(self.ttl_s))
        await pipe.execute()

    async def _flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return
        keys = self.keys.block_sets(self.worker_id)
        pipe = self.redis.pipeline(transaction=False)
        for ev in events:
            key = self.keys.blocks(self.worker_id, ev.medium)
            if ev.kind == "stored" and ev.block_hashes:
                pipe.sadd(key, *[hash_member(h) for h in ev.block_hashes])
            elif ev.kind == "removed" and ev.block_hashes:
                pipe.srem(key, *[hash_member(h) for h in ev.block_hashes])
            elif ev.kind == "cleared":
                pipe.delete(*keys)  # every tier
            # The set first, then the entry: a reader that re-reads the set from an older stream
            # position replays entries it already holds, which changes nothing.
            medium = "device" if ev.kind == "cleared" else ev.medium
            for i in range(0, max(len(ev.block_hashes), 1), MAX_HASHES_PER_ENTRY):
                self._append(pipe, ev.kind, ev.block_hashes[i : i + MAX_HASHES_PER_ENTRY],
                             medium)
        for key in keys:
            pipe.expire(key, int(self.ttl_s))
        try:
            await pipe.execute()
        except Exception:
            with self._lock:  # this batch is lost: owe a rewrite
                self._resync = True
            raise


def by_media(snapshot: Snapshot) -> dict[str, list[int]]:
    """A snapshot as every tier's hashes (a plain list is the device's); ValueError for a medium
    that is none of `MEDIA`."""
    if not isinstance(snapshot, Mapping):
        return {"device": list(snapshot), "host": [], "disk": []}
    unknown = set(snapshot) - set(MEDIA)
    if unknown:
        raise ValueError(f"snapshot names unknown media {sorted(unknown)}")
    return {m: list(snapshot.get(m, ())) for m in MEDIA}
