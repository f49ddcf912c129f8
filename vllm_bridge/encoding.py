"""vLLM's KV event batches as vLLM writes them: the inverse of vllm_bridge/events.py's decoding,
for the fakes and tests (in production a vLLM server is the only writer)."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_bridge.events import BlockRemoved, BlockStored, Event, EventBatch

_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch, *, arrays: bool = False) -> bytes:
    """The inverse of decode_batch, as vLLM 0.32 writes it (events as tagged maps; its fields
    without a default always, the rest only when set) or, with `arrays`, as releases before
    PR 42892 did (tagged arrays, trailing unset fields left out). For fakes and tests."""
    events = [_encode_arrays(ev) if arrays else _encode_map(ev) for ev in batch.events]
    return _ENCODER.encode([batch.ts, events, batch.data_parallel_rank])


def _encode_map(ev: Event) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        out = {"type": "BlockStored", "block_hashes": ev.block_hashes,
               "parent_block_hash": ev.parent_block_hash, "token_ids": ev.token_ids,
               "block_size": ev.block_size, "lora_id": ev.lora_id, "medium": ev.medium,
               "lora_name": ev.lora_name}
        optional = {"extra_keys": ev.extra_keys, "group_idx": ev.group_idx,
                    "kv_cache_spec_kind": ev.kv_cache_spec_kind}
        return out | {k: v for k, v in optional.items() if v is not None}
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": ev.medium,
                "group_idx": ev.group_idx}
    return {"type": "AllBlocksCleared"}


def _encode_arrays(ev: Event) -> list[Any]:
    if isinstance(ev, BlockStored):
        out = ["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids,
               ev.block_size, ev.lora_id, ev.medium, ev.lora_name, ev.extra_keys,
               ev.group_idx, ev.kv_cache_spec_kind]
        required = 5  # tag and the four fields every release has
    elif isinstance(ev, BlockRemoved):
        out, required = ["BlockRemoved", ev.block_hashes, ev.medium, ev.group_idx], 2
    else:
        return ["AllBlocksCleared"]
    while len(out) > required and out[-1] is None:
        out.pop()
    return out
