"""The Redis schema (docs/contract.md "Redis schema"): keys and the registration a router reads.

    tandem:{namespace}:worker:{id}             hash: role, url, model, block_size, capacity,
                                               load (JSON) ...
    tandem:{namespace}:blocks:{ns#shard}:{id}  set of block hashes (`common.hashing.hash_member`)
                                               on the worker's device
    tandem:{namespace}:blocks-host:{ns#shard}:{id}  ... in its host-memory tier
    tandem:{namespace}:blocks-disk:{ns#shard}:{id}  ... in its disk tier
    tandem:{namespace}:events:{ns#shard}       stream of block events (common/block_events.py)

In the keys the braces are literal: they are Redis Cluster hash tags. Worker and block keys
expire unless the worker's heartbeat refreshes them, so a dead worker vanishes from the index by
itself. The worker side (registration, heartbeat, block events) is common/publisher.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import xxhash
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from common.auth import secrets_equal, sign_json
from common.block_events import MEDIA, Medium
from common.bounds import MAX_TOKEN_ID
from common.locality import LOCALITY_PATTERN, MAX_LOCALITY_CHARS
from common.model_identity import NAME_PATTERN, is_name


@dataclass(frozen=True)
class RedisKeys:
    """Every key of one namespace. The part in braces is a Redis Cluster hash tag. A worker's
    block set and its events share the tag of the worker's shard (a hash of its id, one of
    `EVENT_SHARDS`), so a lookup script runs once per shard, not once per worker, and a router
    tails a fixed number of streams however many workers there are; shards spread over the
    cluster's nodes."""

    namespace: str = "default"

    @property
    def prefix(self) -> str:
        return f"tandem:{self.namespace}:"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{{{worker_id}}}"

    def blocks(self, worker_id: str, medium: Medium = "device") -> str:
        """The set of the worker's blocks held in tier `medium` (the device set's key is the
        one of workers before tiers)."""
        if medium not in MEDIA:
            raise ValueError(f"unknown medium {medium!r}; media: {', '.join(MEDIA)}")
        kind = "blocks" if medium == "device" else f"blocks-{medium}"
        return f"{self.prefix}{kind}:{self._tag(self.event_shard(worker_id))}:{worker_id}"

    def block_sets(self, worker_id: str) -> list[str]:
        """Every tier's set of the worker, in `MEDIA` order (one hash tag: one slot)."""
        return [self.blocks(worker_id, m) for m in MEDIA]

    def events(self, shard: int) -> str:
        return f"{self.prefix}events:{self._tag(shard)}"

    def _tag(self, shard: int) -> str:
        return f"{{{self.namespace}#{shard}}}"

    def event_shard(self, worker_id: str) -> int:
        return xxhash.xxh32_intdigest(worker_id.encode()) % EVENT_SHARDS

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}worker:*"

    def worker_id_of(self, key: bytes | str) -> str:
        """The id in a `worker:{id}` key (as SCAN returns it)."""
        text = key.decode(errors="replace") if isinstance(key, bytes) else key
        return text[len(self.prefix) + len("worker:"):].removeprefix("{").removesuffix("}")


EVENT_SHARDS = 16  # streams per namespace; routers and workers must agree (pinned by a test)


_COUNT = Field(0, ge=0, le=1 << 40)
ServedName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


MAX_RELOAD_TOKENS_PER_S = 1e10  # a reported reload rate above this is taken as this


class ReloadRates(BaseModel):
    """Prompt tokens per second a worker measured reloading its KV blocks from each lower tier
    into its device pool; None until measured. A value that is not a finite positive number is
    taken as unmeasured (not a refused registration), one above `MAX_RELOAD_TOKENS_PER_S` as
    that: the router prices tier hits with them (router/policy.py)."""

    model_config = ConfigDict(extra="ignore")

    host: float | None = None
    disk: float | None = None

    @field_validator("host", "disk", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        rate = float(value)
        if not math.isfinite(rate) or rate <= 0:
            return None
        return min(rate, MAX_RELOAD_TOKENS_PER_S)


class WorkerLoad(BaseModel):
    """A worker's `load` field (JSON), as the router reads it: every count bounded."""

    model_config = ConfigDict(extra="ignore")

    running: int = _COUNT
    waiting: int = _COUNT
    parked: int = _COUNT  # requests whose reader fell behind (engine/output_stream.py)
    free_blocks: int = _COUNT  # blocks it can hand out now: empty, or holding a cached block
    # Of those, the ones still holding a cached block (handing one out evicts a prefix-cache
    # entry); None: not reported (a worker before this field), read as none. Above
    # `free_blocks`, taken as `free_blocks`.
    evictable_blocks: int | None = Field(None, ge=0, le=1 << 40)
    num_blocks: int = _COUNT
    held: int = _COUNT
    importing: int = _COUNT
    prefill_inflight: int = _COUNT
    waiting_tokens: int = _COUNT
    reload_tokens_per_s: ReloadRates = Field(default_factory=ReloadRates)

    @field_validator("reload_tokens_per_s", mode="before")
    @classmethod
    def _rates(cls, value: Any) -> Any:
        return value if isinstance(value, dict) else {}  # anything else: unmeasured

    @model_validator(mode="after")
    def _evictable_within_free(self) -> WorkerLoad:
        if self.evictable_blocks is not None and self.evictable_blocks > self.free_blocks:
            self.evictable_blocks = self.free_blocks
        return self


class ProbedModel(BaseModel):
    """Which model a worker serves (docs/contract.md "Registration per model"): the fields of its
    registration, and what its `/ready` tells a router that lists it statically."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field("", max_length=512)
    served_model_names: list[ServedName] = Field([], max_length=32)
    model_digest: str = Field("", pattern=r"^([0-9a-f]{16})?$")
    tokenizer_path: str | None = Field(None, max_length=4096)
    hash_seed: int | None = Field(None, ge=0, lt=1 << 64)
    block_size: int | None = Field(None, ge=1, le=1 << 16)
    max_model_len: int | None = Field(None, ge=1, le=1 << 40)
    # the model's, not the tokenizer's
    vocab_size: int | None = Field(None, ge=1, le=MAX_TOKEN_ID + 1)

    @property
    def names(self) -> list[str]:
        """The names it serves (older workers registered only `model`)."""
        return self.served_model_names or ([self.model] if is_name(self.model) else [])


class WorkerRegistration(ProbedModel):
    """A `worker:{id}` hash as the router reads it. Redis is trusted for availability, not for
    well-formedness: an entry that fails this model is skipped (and counted), never fatal."""

    role: Literal["prefill", "decode", "colocated"]
    # Who answers at `url`: a Tandem worker, or a stock vLLM server whose blocks a
    # `tandem vllm-bridge` publishes (vllm_bridge/); router/backends.py names the protocols.
    backend: Literal["tandem", "vllm"] = "tandem"
    url: str = Field(max_length=512, pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+(:[0-9]{1,5})?$")
    started_at: float = Field(0.0, ge=0, le=1e11)
    block_size: int = Field(16, ge=1, le=1 << 16)
    capacity: int = Field(0, ge=0, le=1 << 40)
    block_bytes: int | None = Field(None, ge=1, le=1 << 40)
    events: str = Field("", pattern=r"^([0-9a-f]{16}:(-1|[0-9]{1,18}))?$")  # "epoch:seq"
    locality: str = Field("", max_length=MAX_LOCALITY_CHARS, pattern=LOCALITY_PATTERN)
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
        for key in ("max_model_len", "block_bytes", "hash_seed", "tokenizer_path", "vocab_size"):
            if info.get(key) in ("", "None"):
                info.pop(key)
        return cls.model_validate(info)


def registration_signature(worker_id: str, fields: dict[str, str], token: str) -> str:
    """HMAC-SHA256 (internal token) over a registration's static fields as stored in Redis (all
    but the changing `load`), so a router that holds the token only routes to (and sends the
    token to) workers that hold it too: writing a hash into Redis does not make a worker."""
    static = {k: v for k, v in fields.items() if k not in ("load", "signature", "events")}
    return sign_json({"worker_id": worker_id, **static}, token)
