"""What a worker's block pool tells the router's index (docs/contract.md "Redis schema"): blocks
stored, blocks removed, or everything cleared. Made by engine/block_pool.py, published by
common/registry.py, and tailed by the routers' replicas (router/replica.py).

The stream entry is the wire format between the two, defined here once (golden vectors in
tests/router/test_replica.py):

    w  worker id            e  epoch: 16 hex digits, new on every full rewrite of the set
    s  sequence number      k  stored | removed | cleared | reset | left
    h  block hashes, packed unsigned 64-bit little-endian (stored / removed only)

`seq` counts from 0 within an epoch, one per entry, so a reader sees a lost entry as a gap.
`reset` opens an epoch: the worker's set was rewritten whole, re-read it. `left`: the worker
deregistered.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["stored", "removed", "cleared"]
EntryKind = Literal["stored", "removed", "cleared", "reset", "left"]

ENTRY_KINDS = frozenset(("stored", "removed", "cleared", "reset", "left"))
MAX_HASHES_PER_ENTRY = 1 << 16
_EPOCH = re.compile(rb"^[0-9a-f]{16}$")
WORKER_ID_PATTERN = r"^[A-Za-z0-9._:\[\]\-]{1,128}$"  # no braces: ids sit inside hash tags
_WORKER_ID = re.compile(WORKER_ID_PATTERN.encode())


@dataclass(frozen=True)
class BlockEvent:
    kind: EventKind
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamEntry:
    """One entry of an `events:{shard}` stream."""

    worker_id: str
    epoch: str
    seq: int
    kind: EntryKind
    block_hashes: tuple[int, ...] = ()

    def fields(self) -> dict[str, bytes]:
        packed = struct.pack(f"<{len(self.block_hashes)}Q", *self.block_hashes)
        return {"w": self.worker_id.encode(), "e": self.epoch.encode(), "s": str(self.seq).encode(),
                "k": self.kind.encode(), "h": packed}

    @classmethod
    def parse(cls, raw: dict[bytes, bytes]) -> StreamEntry:
        """Read one entry as XREAD returns it; anything malformed or out of bounds raises
        ValueError (the stream is written by workers, but Redis is not trusted with shapes)."""
        w, e, s, k, h = (raw.get(f) for f in (b"w", b"e", b"s", b"k", b"h"))
        if w is None or not _WORKER_ID.match(w):
            raise ValueError("bad worker id")
        if e is None or not _EPOCH.match(e):
            raise ValueError("bad epoch")
        if s is None or not s.isdigit() or len(s) > 19:
            raise ValueError("bad sequence number")
        kind = (k or b"").decode(errors="replace")
        if kind not in ENTRY_KINDS:
            raise ValueError(f"bad kind {kind!r}")
        h = h or b""
        if len(h) % 8 or len(h) > 8 * MAX_HASHES_PER_ENTRY:
            raise ValueError("bad block hashes")
        hashes = struct.unpack(f"<{len(h) // 8}Q", h)
        return cls(w.decode(), e.decode(), int(s), kind, hashes)  # type: ignore[arg-type]
