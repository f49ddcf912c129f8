"""The Redis schema (DESIGN.md "Redis schema") and the worker side of it.

    tandem:{namespace}:worker:{id}   hash: role, url, model, block_size, capacity, load (JSON) ...
    tandem:{namespace}:blocks:{id}   set of block hashes (`common.hashing.hash_member`)

Both keys expire unless the worker's heartbeat refreshes them, so a dead worker vanishes from
the index by itself. Block events are applied in batched pipelines; after any (re)connect the
worker rewrites its whole set, so a restarted or emptied Redis heals itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from common.auth import secrets_equal, sign_json
from common.background import BackgroundErrors
from common.block_events import BlockEvent
from common.hashing import hash_member
from common.model_identity import NAME_PATTERN, is_name

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0  # the most a worker's shutdown waits on each Redis step


@dataclass(frozen=True)
class RedisKeys:
    namespace: str = "default"

    @property
    def prefix(self) -> str:
        return f"tandem:{self.namespace}:"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{worker_id}"

    def blocks(self, worker_id: str) -> str:
        return f"{self.prefix}blocks:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}worker:*"


_COUNT = Field(0, ge=0, le=1 << 40)
ServedName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


class WorkerLoad(BaseModel):
    """A worker's `load` field (JSON), as the router reads it: every count bounded."""

    model_config = ConfigDict(extra="ignore")

    running: int = _COUNT
    waiting: int = _COUNT
    free_blocks: int = _COUNT
    num_blocks: int = _COUNT
    held: int = _COUNT
    importing: int = _COUNT
    prefill_inflight: int = _COUNT
    waiting_tokens: int = _COUNT


class ProbedModel(BaseModel):
    """Which model a worker serves (DESIGN.md "Registration per model"): the fields of its
    registration, and what its `/ready` tells a router that lists it statically."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field("", max_length=512)
    served_model_names: list[ServedName] = Field([], max_length=32)
    model_digest: str = Field("", pattern=r"^([0-9a-f]{16})?$")
    tokenizer_path: str | None = Field(None, max_length=4096)
    hash_seed: int | None = Field(None, ge=0, lt=1 << 64)
    block_size: int | None = Field(None, ge=1, le=1 << 16)
    max_model_len: int | None = Field(None, ge=1, le=1 << 40)

    @property
    def names(self) -> list[str]:
        """The names it serves (older workers registered only `model`)."""
        return self.served_model_names or ([self.model] if is_name(self.model) else [])


class WorkerRegistration(ProbedModel):
    """A `worker:{id}` hash as the router reads it. Redis is trusted for availability, not for
    well-formedness: an entry that fails this model is skipped (and counted), never fatal."""

    role: Literal["prefill", "decode", "colocated"]
    url: str = Field(max_length=512, pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?$")
    started_at: float = Field(0.0, ge=0, le=1e11)
    block_size: int = Field(16, ge=1, le=1 << 16)
    capacity: int = Field(0, ge=0, le=1 << 40)
    block_bytes: int | None = Field(None, ge=1, le=1 << 40)
    load: WorkerLoad = Field(default_factory=WorkerLoad)

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes], worker_id: str = "",
                  token: str | None = None) -> WorkerRegistration:
        """Parse a raw HGETALL answer, checking its signature when `token` is given; raises
        ValueError (pydantic's, a decoding one, or a missing or wrong signature)."""
        info: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
        if token:
            given = info.get("signature", "")
            if not secrets_equal(given, registration_signature(worker_id, info, token)):
                raise ValueError("not signed with this cluster's internal token")
        info["load"] = WorkerLoad.model_validate_json(info.get("load") or "{}")
        if "served_model_names" in info:
            info["served_model_names"] = json.loads(info["served_model_names"])
        for key in ("max_model_len", "block_bytes", "hash_seed", "tokenizer_path"):
            if info.get(key) in ("", "None"):
                info.pop(key)
        return cls.model_validate(info)


def registration_signature(worker_id: str, fields: dict[str, str], token: str) -> str:
    """HMAC-SHA256 (internal token) over a registration's static fields as stored in Redis (all
    but the changing `load`), so a router that holds the token only routes to (and sends the
    token to) workers that hold it too: writing a hash into Redis does not make a worker."""
    static = {k: v for k, v in fields.items() if k not in ("load", "signature")}
    return sign_json({"worker_id": worker_id, **static}, token)


class WorkerPublisher:
    """Registers one worker and mirrors its cached block hashes into Redis.

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
        snapshot: Callable[[], Awaitable[list[int]]],
        load: Callable[[], dict[str, Any]],
        ttl_s: float = 10.0,
        flush_interval_s: float = 0.02,
        max_pending: int = 100_000,
        errors: BackgroundErrors | None = None,
        token: str | None = None,
    ) -> None:
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.keys = keys
        self.worker_id = worker_id
        self.info = info
        self._fields = {k: (json.dumps(v) if isinstance(v, dict | list) else str(v)) for k, v in info.items()}
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
                                                         self.keys.blocks(self.worker_id)),
                                       CLOSE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - best effort on shutdown
                log.warning("could not deregister %s from Redis: %s", self.worker_id, e)
        await self.redis.aclose()

    async def _run(self) -> None:
        next_beat = 0.0
        backoff = 0.2
        loop = asyncio.get_running_loop()
        while True:
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
                    log.warning("redis: lost connection (%s); requests continue, index resyncs later", e)
                self.connected = False
                with self._lock:
                    self._pending.clear()
                    self._resync = True
                next_beat = 0.0
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _rewrite(self) -> None:
        with self._lock:
            self._resync = False
            self._pending.clear()
        # Events after this point queue up; the snapshot is taken on the engine thread, so the
        # set written is consistent with the events that follow it.
        hashes = await self._snapshot()
        key = self.keys.blocks(self.worker_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)
        members = [hash_member(h) for h in hashes]
        for i in range(0, len(members), 10_000):
            pipe.sadd(key, *members[i : i + 10_000])
        pipe.expire(key, int(self.ttl_s))
        await pipe.execute()
        self.num_resyncs += 1

    async def _heartbeat(self) -> None:
        wkey, bkey = self.keys.worker(self.worker_id), self.keys.blocks(self.worker_id)
        fields = {**self._fields, "load": json.dumps(self._load())}
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(wkey, mapping=fields)
        pipe.expire(wkey, int(self.ttl_s))
        pipe.expire(bkey, int(self.ttl_s))
        await pipe.execute()

    async def _flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return
        key = self.keys.blocks(self.worker_id)
        pipe = self.redis.pipeline(transaction=False)
        for ev in events:
            if ev.kind == "stored":
                pipe.sadd(key, *[hash_member(h) for h in ev.block_hashes])
            elif ev.kind == "removed":
                pipe.srem(key, *[hash_member(h) for h in ev.block_hashes])
            elif ev.kind == "cleared":
                pipe.delete(key)
        pipe.expire(key, int(self.ttl_s))
        try:
            await pipe.execute()
        except Exception:
            with self._lock:  # this batch is lost: owe a rewrite
                self._resync = True
            raise
