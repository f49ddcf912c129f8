"""The one definition of KV-cache block hashes (docs/contract.md "Block hashing").

The router and every worker hash prompts with these functions; if the two sides ever disagree the
prefix-cache hit rate silently drops to zero, so `tests/common/test_hashing.py` pins golden vectors.

    seed  = xxh3_64("{model_id}|{block_size}|{salt}")          as 8 bytes little-endian
    root  = seed, or with a request's cache salt:
            xxh3_64(seed as 8 bytes LE + "cache_salt:{cache_salt}")
    h_0   = xxh3_64(root  + tokens_0)                          tokens packed as uint32 LE
    h_i   = xxh3_64(h_{i-1} as 8 bytes LE + tokens_i)

Only full blocks are hashed: a prompt of n tokens has n // block_size hashes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

_U64_BYTES = 8
_ARRAY_IS_U32_LE = array("I").itemsize == 4 and sys.byteorder == "little"


def hash_seed(model_id: str, block_size: int, salt: str | None = None) -> int:
    """Seed of the hash chain; per model, block size and (optional) tenant salt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return xxhash.xxh3_64_intdigest(f"{model_id}|{block_size}|{salt or ''}".encode())


def chain_root(seed: int, cache_salt: str | None = None) -> int:
    """Where a request's chain starts: the seed, or with a per-request `cache_salt` (vLLM's
    field; the router also derives one per API key) a root that no other salt shares, so its
    blocks match only requests with the same salt."""
    if not cache_salt:
        return seed
    return xxhash.xxh3_64_intdigest(seed.to_bytes(_U64_BYTES, "little")
                                    + b"cache_salt:" + cache_salt.encode())


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the previous block's hash (or the seed for block 0)."""
    data = parent_hash.to_bytes(_U64_BYTES, "little") + _pack_tokens(token_ids)
    return xxhash.xxh3_64_intdigest(data)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    seed: int,
    parent_hash: int | None = None,
) -> list[int]:
    """Chain hashes of every full block of `token_ids`.

    `parent_hash` continues an existing chain (the hash of the block before `token_ids[0]`);
    `None` starts a new chain from `seed`.
    """
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    packed = _pack_tokens(token_ids[: num_full * block_size])
    step = block_size * 4
    prev = seed if parent_hash is None else parent_hash
    hashes: list[int] = []
    for i in range(num_full):
        prev = xxhash.xxh3_64_intdigest(
            prev.to_bytes(_U64_BYTES, "little") + packed[i * step : (i + 1) * step]
        )
        hashes.append(prev)
    return hashes


class BlockHasher:
    """Hashes prompts for one (model, block size, salt); both router and engine hold one."""

    def __init__(self, model_id: str, block_size: int, salt: str | None = None) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self.salt = salt
        self.seed = hash_seed(model_id, block_size, salt)

    def __call__(self, token_ids: Sequence[int], parent_hash: int | None = None,
                 cache_salt: str | None = None) -> list[int]:
        """The chain of `token_ids`' full blocks: continuing `parent_hash`, else from the
        request's root (`cache_salt`)."""
        if parent_hash is None:
            parent_hash = chain_root(self.seed, cache_salt)
        return hash_blocks(token_ids, self.block_size, self.seed, parent_hash)


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    if _ARRAY_IS_U32_LE and isinstance(token_ids, list):
        # Lists (every router request) pack 3-15x faster through array than through numpy.
        try:
            return array("I", token_ids).tobytes()
        except (OverflowError, TypeError) as e:
            raise ValueError("token ids must fit in uint32") from e
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4").tobytes()


def hash_tokens(token_ids: Sequence[int]) -> int:
    """xxh3_64 of a whole token sequence (uint32 LE): a cheap identity of a prompt, not a block
    hash (signed KV handles carry it, so a handle can only fill the prompt it was issued for)."""
    return xxhash.xxh3_64_intdigest(_pack_tokens(token_ids))


def hash_member(block_hash: int) -> str:
    """A block hash as a Redis set member: the signed 64-bit decimal string (Redis stores
    integer-like strings compactly; the router and workers must use this same form)."""
    return str(block_hash - (1 << 64) if block_hash >= 1 << 63 else block_hash)


def member_hash(member: bytes | str) -> int | None:
    """The block hash a set member stands for (`hash_member`'s inverse); None if malformed."""
    text = member.decode(errors="replace") if isinstance(member, bytes) else member
    try:
        value = int(text) if len(text) <= 20 else None
    except ValueError:
        return None
    if value is None or not -(1 << 63) <= value < (1 << 63):
        return None
    return value + (1 << 64) if value < 0 else value
