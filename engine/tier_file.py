"""The disk tier's block file (docs/contract.md "KV tier files"): one KV block per file, named
after its hash, with a header that says what makes the block valid for a worker.

    offset  size  field
    0       4     magic b"TKVB"
    4       2     format version, u16 little-endian (1)
    6       2     n: length of the metadata, u16 little-endian (at most 1024)
    8       n     metadata: JSON, UTF-8, keys sorted, no spaces:
                    block_hash     the block's hash, 16 hex digits (also the file's name)
                    block_size     tokens per block
                    checksum       zlib.crc32 of the payload
                    dtype          the KV cache's torch dtype ("float32", "bfloat16", ...)
                    hash_seed      the hash chain's seed (common/hashing.py), 16 hex digits
                    layout         the KV layout's order (kv_transfer/layout.py)
                    model_digest   common/model_identity.py
                    payload_bytes  length of the payload
                    shape          one block: [num_layers, 2, block_size, num_kv_heads, head_dim]
    8 + n   ...   payload: the block's bytes as the KV cache holds them

A file is served only if every field matches the reading worker's `BlockFormat`, its length is
exactly 8 + n + payload_bytes and the checksum matches; the golden vector in
tests/engine/test_kv_tiers.py pins the encoding.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"TKVB"
VERSION = 1
MAX_META_BYTES = 1024
SUFFIX = ".kvb"
_PREFIX = struct.Struct("<4sHH")
_NAME = re.compile(r"^([0-9a-f]{16})\.kvb$")
_IDENTITY = ("block_size", "dtype", "hash_seed", "layout", "model_digest", "shape")


class TierFileError(ValueError):
    """A block file that must not be served; `reason` is one of corrupt, truncated, foreign,
    stale (what the worker counts it under)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class BlockFormat:
    """What a block file must match to be served by this worker (everything but its hash and
    checksum)."""

    model_digest: str
    layout: str
    block_size: int
    hash_seed: int
    dtype: str
    shape: tuple[int, ...]
    element_size: int

    @property
    def payload_bytes(self) -> int:
        n = self.element_size
        for d in self.shape:
            n *= d
        return n

    @property
    def file_bytes_max(self) -> int:
        return _PREFIX.size + MAX_META_BYTES + self.payload_bytes

    def identity(self) -> dict:
        return {"block_size": self.block_size, "dtype": self.dtype,
                "hash_seed": f"{self.hash_seed:016x}", "layout": self.layout,
                "model_digest": self.model_digest, "shape": list(self.shape)}


def file_name(block_hash: int) -> str:
    return f"{block_hash:016x}{SUFFIX}"


def hash_of_name(name: str) -> int | None:
    """The block hash a file name stands for; None if it is no block file's name."""
    m = _NAME.match(name)
    return int(m.group(1), 16) if m else None


def encode_header(fmt: BlockFormat, block_hash: int, payload: memoryview | bytes) -> bytes:
    """The header of the file holding `payload` as block `block_hash`."""
    if len(payload) != fmt.payload_bytes:
        raise ValueError(f"payload of {len(payload)} bytes, the format says {fmt.payload_bytes}")
    meta = {**fmt.identity(), "block_hash": f"{block_hash:016x}",
            "checksum": zlib.crc32(payload), "payload_bytes": len(payload)}
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    if len(raw) > MAX_META_BYTES:
        raise ValueError("block file metadata too long")
    return _PREFIX.pack(MAGIC, VERSION, len(raw)) + raw


def decode(fmt: BlockFormat, block_hash: int, data: memoryview | bytes) -> memoryview:
    """The payload of a whole file's bytes `data`, checked against `fmt` and `block_hash`;
    raises `TierFileError` saying why it must not be served."""
    data = memoryview(data)
    if len(data) < _PREFIX.size:
        raise TierFileError("truncated", "shorter than its header")
    magic, version, n = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise TierFileError("corrupt", "bad magic")
    if version != VERSION:
        raise TierFileError("stale", f"format version {version}")
    if n > MAX_META_BYTES:
        raise TierFileError("corrupt", "metadata too long")
    if len(data) < _PREFIX.size + n:
        raise TierFileError("truncated", "shorter than its metadata")
    try:
        meta = json.loads(bytes(data[_PREFIX.size:_PREFIX.size + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise TierFileError("corrupt", "metadata is no JSON") from e
    if not isinstance(meta, dict):
        raise TierFileError("corrupt", "metadata is no object")
    expected = fmt.identity()
    diffs = [k for k in _IDENTITY if meta.get(k) != expected[k]]
    if diffs:
        raise TierFileError("foreign", "differs in " + ", ".join(diffs))
    if meta.get("block_hash") != f"{block_hash:016x}":
        raise TierFileError("corrupt", "holds another block")
    size, checksum = meta.get("payload_bytes"), meta.get("checksum")
    if size != fmt.payload_bytes or not isinstance(checksum, int):
        raise TierFileError("corrupt", "bad payload size or checksum field")
    payload = data[_PREFIX.size + n:]
    if len(payload) < size:
        raise TierFileError("truncated", f"{len(payload)} of {size} payload bytes")
    if len(payload) > size:
        raise TierFileError("corrupt", "trailing bytes")
    if zlib.crc32(payload) != checksum:
        raise TierFileError("corrupt", "checksum mismatch")
    return payload
