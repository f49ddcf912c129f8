"""vLLM's KV cache events on the wire (vllm/distributed/kv_events.py), defined here once.

A ZMQ message is three frames: topic, sequence number (8 bytes big-endian), payload. The payload
is msgpack: the batch is a positional array `[ts, events, data_parallel_rank]` (the oldest
releases leave the rank out), and each event is

- a tagged map `{"type": "BlockStored", "block_hashes": ..., ...}` (vLLM >= PR 42892; 0.32), or
- a tagged array, the fields in declaration order with trailing defaults left out:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]` (the oldest releases end at
  `lora_id`), `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`.

vLLM's KV offloading reports the blocks it copies to CPU memory or disk as BlockStored with that
`medium` ("CPU", "Disk"), no token ids, no parent and `block_size` the offloaded block's, or 0
(newer releases): such an event (no token ids, a medium other than the GPU) is taken as it is,
and block size 0 only there.

Both decode to the frozen dataclasses below. The payload comes from a peer process: every size is
bounded and anything malformed raises ValueError with the reason. An event of an unknown type is
skipped and counted (`EventBatch.num_unknown`); unknown map keys and extra trailing array fields
are ignored (each vLLM release adds optional fields), never fatal.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Raw, Struct

MAX_EVENTS_PER_BATCH = 1 << 16  # 0.32 sends one BlockRemoved per evicted block
MAX_HASHES_PER_EVENT = 1 << 16  # a full report of a 1M-token prefix at block size 16
MAX_TOKENS_PER_EVENT = 1 << 20  # that report's tokens
MAX_TOKENS_PER_BATCH = 1 << 21  # one engine step: that report and as much again
# The largest honest batch: 2^21 token ids of at most 5 bytes (10 MiB) and their 2^17 hashes at
# block size 16 as raw 32-byte digests (4.3 MiB; vLLM's default ints take 9 bytes, 1.1 MiB), with
# the events' framing: under 14.5 MiB. The bridge's sockets refuse larger frames (link.py).
MAX_PAYLOAD_BYTES = 16 << 20
MAX_BLOCK_SIZE = 1 << 16
MAX_HASH_BYTES = 64  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends raw digests (32 bytes today)
MAX_NAME_CHARS = 1024  # medium, lora_name, kv_cache_spec_kind

VLLMHash = int | bytes  # an int in [0, 2**64), or a raw digest of 1-64 bytes

KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of full blocks cached, chained after `parent_block_hash` (None: from token 0).
    `token_ids` covers the whole run; `extra_keys` has one entry per block (None: plain tokens).
    On a medium other than the GPU (KV offloading), `token_ids` may be empty and `block_size`
    0."""

    block_hashes: tuple[VLLMHash, ...]
    parent_block_hash: VLLMHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple | None
    group_idx: int  # KV cache group; None on the wire (older releases) means 0
    medium: str | None
    lora_name: str | None
    lora_id: int | None = None  # deprecated on the wire; the only LoRA marker of old releases
    kv_cache_spec_kind: str | None = None  # "full_attention", "sliding_window", "mamba", ...


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[VLLMHash, ...]
    medium: str | None
    group_idx: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One engine step's events, in order. `num_unknown`: events of unknown types skipped."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None
    num_unknown: int = 0


# --- wire shapes: msgspec checks types and bounds while it decodes ---------------------------

_Hash = (Annotated[int, Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
         | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)])
_Hashes = Annotated[tuple[_Hash, ...], Meta(max_length=MAX_HASHES_PER_EVENT)]
_TokenIds = Annotated[tuple[Annotated[int, Meta(ge=0, lt=1 << 32)], ...],
                      Meta(max_length=MAX_TOKENS_PER_EVENT)]
_BlockSize = Annotated[int, Meta(ge=0, le=MAX_BLOCK_SIZE)]  # 0: offloaded (checked in _stored)
_Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
_ExtraKeys = Annotated[tuple[Any, ...], Meta(max_length=MAX_HASHES_PER_EVENT)]
_Index = Annotated[int, Meta(ge=0, lt=1 << 16)]  # group index, data-parallel rank
_LoraId = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


# Each event's fields once; vLLM >= 0.32 sends them as tagged maps, older releases as tagged
# arrays in this field order (the subclasses below differ only in that encoding).
class _Stored(Struct):
    block_hashes: _Hashes
    parent_block_hash: _Hash | None
    token_ids: _TokenIds
    block_size: _BlockSize
    lora_id: _LoraId | None = None
    medium: _Name | None = None
    lora_name: _Name | None = None
    extra_keys: _ExtraKeys | None = None
    group_idx: _Index | None = None
    kv_cache_spec_kind: _Name | None = None


class _Removed(Struct):
    block_hashes: _Hashes
    medium: _Name | None = None
    group_idx: _Index | None = None


class _MapStored(_Stored, tag="BlockStored", tag_field="type"):
    pass


class _MapRemoved(_Removed, tag="BlockRemoved", tag_field="type"):
    pass


class _MapCleared(Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _ArrayStored(_Stored, tag="BlockStored", array_like=True):
    pass


class _ArrayRemoved(_Removed, tag="BlockRemoved", array_like=True):
    pass


class _ArrayCleared(Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _ArrayBatch(Struct, array_like=True):
    ts: float
    events: Annotated[list[Raw], Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: _Index | None = None


class _MapBatch(Struct):  # a transitional vLLM main branch encoded the batch as a map too
    ts: float
    events: Annotated[list[Raw], Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: _Index | None = None


_MAP_EVENT = msgspec.msgpack.Decoder(_MapStored | _MapRemoved | _MapCleared)
_ARRAY_EVENT = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)
_ARRAY_BATCH = msgspec.msgpack.Decoder(_ArrayBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)


def _shape(data) -> str:
    """"map", "array" or "other", from a msgpack value's first byte."""
    first = memoryview(data)[0] if len(data) else 0xC1
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "array"
    return "other"


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """One ZMQ payload (the third frame) as an EventBatch; ValueError if malformed."""
    reader = BatchReader(payload)  # (arguments are evaluated in order: num_unknown is final)
    return EventBatch(reader.ts, tuple(reader), reader.data_parallel_rank, reader.num_unknown)


class BatchReader:
    """One payload's batch, its events decoded one at a time as they are iterated: decoded, a
    token id costs ~40 bytes, so the bridge holds one event's, not a whole batch's. Raises
    ValueError as decode_batch does; `num_unknown` counts the events skipped so far."""

    def __init__(self, payload: bytes | memoryview) -> None:
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        shape = _shape(payload)
        if shape == "other":
            raise ValueError("payload is not a msgpack array or map")
        try:
            wire = (_ARRAY_BATCH if shape == "array" else _MAP_BATCH).decode(payload)
        except msgspec.DecodeError as e:
            raise ValueError(f"malformed event batch: {e}") from e
        if not math.isfinite(wire.ts):
            raise ValueError("event batch timestamp is not finite")
        self.ts, self.data_parallel_rank = wire.ts, wire.data_parallel_rank
        self._raw = wire.events
        self.num_unknown = 0

    def __iter__(self) -> Iterator[Event]:
        num_tokens = 0
        for i, raw in enumerate(self._raw):
            event = _decode_event(raw, i)
            if event is None:
                self.num_unknown += 1
                continue
            if isinstance(event, BlockStored):
                num_tokens += len(event.token_ids)
                if num_tokens > MAX_TOKENS_PER_BATCH:
                    raise ValueError(f"event batch of over {MAX_TOKENS_PER_BATCH} token ids")
            yield event
            del event  # not held while the next one decodes


def _decode_event(raw: Raw, index: int) -> Event | None:
    """One event, or None if its type is unknown."""
    shape = _shape(raw)
    if shape == "other":
        raise ValueError(f"event {index} is not a map or an array")
    try:
        wire = (_MAP_EVENT if shape == "map" else _ARRAY_EVENT).decode(raw)
    except msgspec.DecodeError as e:
        if _tag(raw, shape, index) not in KNOWN_TYPES:
            return None
        raise ValueError(f"malformed event {index}: {e}") from e
    if isinstance(wire, _Stored):
        return _stored(wire, index)
    if isinstance(wire, _Removed):
        return BlockRemoved(wire.block_hashes, wire.medium, wire.group_idx or 0)
    return AllBlocksCleared()


def _tag(raw: Raw, shape: str, index: int) -> str:
    """The type tag of an event that did not decode; ValueError if it has none."""
    try:
        if shape == "map":
            tag = msgspec.msgpack.decode(raw, type=dict[str, Raw]).get("type")
        else:
            tag = next(iter(msgspec.msgpack.decode(raw, type=tuple[Raw, ...])), None)
        if tag is not None:
            return msgspec.msgpack.decode(tag, type=Annotated[str, Meta(max_length=256)])
    except msgspec.DecodeError:
        pass
    raise ValueError(f"event {index} has no type tag")


def _stored(wire: _Stored, index: int) -> BlockStored:
    num_blocks, num_tokens = len(wire.block_hashes), len(wire.token_ids)
    if num_tokens == 0 and wire.medium not in (None, "GPU"):
        # An offloading connector's report: hashes of blocks copied to another medium, no
        # tokens, the offloaded block size or 0.
        return BlockStored(wire.block_hashes, wire.parent_block_hash, (), wire.block_size,
                           None, wire.group_idx or 0, wire.medium, wire.lora_name,
                           wire.lora_id, wire.kv_cache_spec_kind)
    if wire.block_size == 0:
        raise ValueError(f"event {index}: block size 0")
    # Blocks vLLM masked or nulled (sliding window) are left out of the hashes but not of the
    # tokens, so the tokens may cover more blocks than the hashes name, never fewer.
    if num_tokens % wire.block_size or num_tokens < num_blocks * wire.block_size:
        raise ValueError(f"event {index}: {num_tokens} token ids for {num_blocks} blocks of "
                         f"{wire.block_size}")
    if wire.extra_keys is not None and len(wire.extra_keys) != num_blocks:
        raise ValueError(f"event {index}: {len(wire.extra_keys)} extra keys for {num_blocks} "
                         "blocks")
    return BlockStored(wire.block_hashes, wire.parent_block_hash, wire.token_ids,
                       wire.block_size, wire.extra_keys, wire.group_idx or 0, wire.medium,
                       wire.lora_name, wire.lora_id, wire.kv_cache_spec_kind)
