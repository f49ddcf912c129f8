"""Keeps a router's BlockReplica (router/replica.py) in step with the workers' block sets.

The feed tails the namespace's `EVENT_SHARDS` event streams (common/block_events.py) and applies
each entry. Redis stays the source of truth: a worker's set is re-read with SMEMBERS when

- the worker is new to this router (or Redis lost its data, or the connection came back),
- its entries open a new epoch (`reset`: the worker rewrote its set after a reconnect),
- a sequence number is skipped (the stream was trimmed past this reader, or an entry was lost
  in a failover), or the worker's heartbeat names a later entry than the feed has seen once the
  streams are read to their end.

Re-reading at a stream position older than the set is safe: entries replayed onto a newer set
end with the same state, since the last entry for a hash (in one tier) decides it. A worker's
set is one per tier (common/registry.py `block_sets`): all are re-read together.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from common.background import BackgroundErrors, cancelling
from common.block_events import MEDIA, StreamEntry
from common.hashing import member_hash
from common.registry import EVENT_SHARDS, RedisKeys
from router.replica import BlockReplica

log = logging.getLogger(__name__)

READ_COUNT = 2000  # entries per stream per read
SNAPSHOTS_PER_POLL = 32  # set re-reads per poll, so a fleet joining at once is spread out
SNAPSHOT_SLICE = 20_000  # set members applied between two yields to the event loop
ENTRIES_PER_YIELD = 64  # stream entries applied between two yields to the event loop
# What one worker's set may hold in the replica: its registered capacity (KV blocks), with
# slack for events in flight, or this where it registered none. A Redis writer who forges
# `stored` entries or set members under a real worker's id gets no further than that. A lower
# tier (host, disk) has no registered capacity: it may hold up to MAX_BLOCKS_PER_WORKER.
MIN_BLOCKS_PER_WORKER = 4096
MAX_BLOCKS_PER_WORKER = 1 << 20
_MASK = (1 << 64) - 1


@dataclass
class _Cursor:
    epoch: str | None = None  # None: re-read; the next entry sets the baseline
    seq: int | None = None


class ReplicaFeed:
    def __init__(self, redis, keys: RedisKeys, replica: BlockReplica,
                 errors: BackgroundErrors | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.replica = replica
        self.errors = errors or BackgroundErrors()
        self._stream_ids: dict[int, bytes] | None = None  # shard -> last id read
        self._cursors: dict[str, _Cursor] = {}  # tracked workers
        self._heartbeats: dict[str, tuple[str, int]] = {}  # what registrations last said
        self._stale: set[str] = set()  # workers whose set must be re-read
        self._caps: dict[str, int] = {}  # worker id -> most blocks its set may hold here
        self.num_snapshots = 0
        self.num_gaps = 0
        self.num_entries = 0

    # ---- which workers -----------------------------------------------------------------------

    def track(self, workers: dict[str, str], capacities: dict[str, int] | None = None) -> None:
        """The Redis-registered workers now, with their registrations' `events` ("epoch:seq"):
        newcomers are read in full, leavers dropped."""
        capacities = capacities or {}
        self._caps = {wid: max(2 * capacities[wid], MIN_BLOCKS_PER_WORKER)
                      if capacities.get(wid) else MAX_BLOCKS_PER_WORKER for wid in workers}
        for wid in list(self._cursors):
            if wid not in workers:
                self._forget(wid)
        for wid, events in workers.items():
            if wid not in self._cursors:
                self._cursors[wid] = _Cursor()
                self._stale.add(wid)
            epoch, _, seq = events.partition(":")
            if epoch:
                self._heartbeats[wid] = (epoch, int(seq))

    def resync_all(self) -> None:
        """Redis lost its data or the connection was down: re-read every stream tail and set."""
        self._stream_ids = None
        for wid, cursor in self._cursors.items():
            cursor.epoch = cursor.seq = None
            self._stale.add(wid)

    def _forget(self, wid: str) -> None:
        self._cursors.pop(wid, None)
        self._heartbeats.pop(wid, None)
        self._stale.discard(wid)
        self.replica.drop(wid)

    # ---- one round ---------------------------------------------------------------------------

    async def poll(self) -> None:
        """Read every stream to its end (or READ_COUNT entries each), then re-read stale sets."""
        if self._stream_ids is None:
            # Where the streams end now, before any set is read: entries after this replay.
            pipe = self.redis.pipeline(transaction=False)
            for shard in range(EVENT_SHARDS):
                pipe.xrevrange(self.keys.events(shard), count=1)
            tails = await pipe.execute(raise_on_error=False)
            self._stream_ids = {s: (t[0][0] if t and not isinstance(t, Exception) else b"0-0")
                                for s, t in enumerate(tails)}
        beats = dict(self._heartbeats)  # read before the streams: they name older entries
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(EVENT_SHARDS):
            pipe.xread({self.keys.events(shard): self._stream_ids[shard]}, count=READ_COUNT)
        # Each stream on its own: a key of the wrong type is skipped (and counted), not an
        # error that stops every shard's feed.
        replies = await pipe.execute(raise_on_error=False)
        drained = True
        applied = 0
        for shard, reply in enumerate(replies):
            if isinstance(reply, Exception):
                self.errors.record("index_feed", f"stream {shard} unreadable: {reply}")
                continue
            for _stream, entries in reply or ():
                drained &= len(entries) < READ_COUNT
                for entry_id, fields in entries:
                    self._stream_ids[shard] = entry_id
                    self._apply(fields)
                    applied += 1
                    if applied % ENTRIES_PER_YIELD == 0:
                        await asyncio.sleep(0)  # lookups (and /health) do not wait for a flood
        if drained:
            self._check_heartbeats(beats)
        await self._snapshot()

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        try:
            e = StreamEntry.parse(fields)
        except ValueError as exc:
            self.errors.record("index_feed", f"malformed block event skipped: {exc}")
            return
        self.num_entries += 1
        cursor = self._cursors.get(e.worker_id)
        if cursor is None:
            return  # not (yet) a registered worker: read in full once it is
        if e.kind == "left":  # deregistered: gone now, not at the next directory refresh
            self._forget(e.worker_id)
            return
        if e.kind == "reset" or cursor.epoch is None:
            if e.kind == "reset":
                self._stale.add(e.worker_id)
        elif e.epoch != cursor.epoch or e.seq != cursor.seq + 1:
            self.num_gaps += 1
            self._stale.add(e.worker_id)
        cursor.epoch, cursor.seq = e.epoch, e.seq
        if e.kind == "stored":
            held = self.replica.num_blocks(e.worker_id, e.medium)
            if held + len(e.block_hashes) > self._cap(e.worker_id, e.medium):
                self.errors.record("index_feed", f"worker {e.worker_id!r} claims more blocks "
                                   f"than it can hold ({e.medium}): entry skipped")
                return
            self.replica.add(e.worker_id, e.block_hashes, e.medium)
        elif e.kind == "removed":
            self.replica.remove(e.worker_id, e.block_hashes, e.medium)
        elif e.kind == "cleared":
            self.replica.clear(e.worker_id)

    def _check_heartbeats(self, beats: dict[str, tuple[str, int]]) -> None:
        """With every stream read to its end, a heartbeat naming an entry this feed has not
        seen means that entry is gone (trimmed, or lost in a failover)."""
        for wid, (epoch, seq) in beats.items():
            cursor = self._cursors.get(wid)
            if cursor is None or cursor.epoch is None or wid in self._stale:
                continue
            if epoch != cursor.epoch or seq > cursor.seq:
                self.num_gaps += 1
                self._stale.add(wid)
                cursor.epoch = cursor.seq = None

    async def _snapshot(self) -> None:
        wids = [w for w in list(self._stale)[:SNAPSHOTS_PER_POLL] if w in self._cursors]
        if not wids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for wid in wids:
            for key in self.keys.block_sets(wid):
                pipe.scard(key)
        sizes = await pipe.execute(raise_on_error=False)
        readable = []
        for n, wid in enumerate(wids):
            problem = None
            for medium, size in zip(MEDIA, sizes[3 * n : 3 * n + 3], strict=True):
                if isinstance(size, Exception):
                    problem = f"{medium}: {size}"
                elif size > self._cap(wid, medium):
                    problem = f"{medium}: too large"
            if problem is not None:
                self._stale.discard(wid)  # re-read when its next epoch or gap says so
                self.replica.clear(wid)
                self.errors.record("index_feed", f"block set of {wid!r} skipped: {problem}")
            else:
                readable.append(wid)
        if not readable:
            return
        pipe = self.redis.pipeline(transaction=False)
        for wid in readable:
            for key in self.keys.block_sets(wid):
                pipe.smembers(key)
        sets = await pipe.execute(raise_on_error=False)
        for n, wid in enumerate(readable):
            self._stale.discard(wid)
            self.replica.clear(wid)
            tiers = sets[3 * n : 3 * n + 3]
            broken = next((m for m in tiers if isinstance(m, Exception)), None)
            if broken is not None:
                self.errors.record("index_feed", f"block set of {wid!r} unreadable: {broken}")
                continue
            for medium, members in zip(MEDIA, tiers, strict=True):
                members = list(members)
                # In slices, yielding between them: a fleet's sets are millions of entries, and
                # lookups must not wait for them (a half-read set only costs misses meanwhile).
                for i in range(0, len(members), SNAPSHOT_SLICE):
                    self.replica.add(wid, _hashes(members[i : i + SNAPSHOT_SLICE]), medium)
                    await asyncio.sleep(0)
            self.num_snapshots += 1

    def _cap(self, wid: str, medium: str = "device") -> int:
        if medium != "device":
            return MAX_BLOCKS_PER_WORKER
        return self._caps.get(wid, MAX_BLOCKS_PER_WORKER)

    async def run(self, interval_s: float) -> None:
        failing = False
        while not cancelling():
            try:
                await self.poll()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any Redis failure or bad data: retry
                self.errors.record("index_feed", e)
                if not failing:
                    log.warning("index feed: %s; the replica re-reads Redis when it answers", e)
                    self.resync_all()
                failing = True
            await asyncio.sleep(interval_s)


def _hashes(members: list[bytes]) -> list[int]:
    """Set members (`hash_member` strings) as block hashes; the fast path parses them all at
    once, and a slice with anything malformed is parsed member by member, skipping the bad."""
    try:
        values = [int(m) for m in members]
        if all(-(1 << 63) <= v < (1 << 63) for v in values):
            return [v & _MASK for v in values]
    except ValueError:
        pass
    return [h for h in map(member_hash, members) if h is not None]

