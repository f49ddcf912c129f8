"""What a worker's block pool tells the router's index (docs/contract.md "Redis schema"): blocks
stored, blocks removed, or everything cleared. Made by engine/block_pool.py, published by
common/registry.py, and tailed by the routers' replicas (router/replica.py).

The stream entry is the wire format between the two, defined here once (golden vectors in
tests/router/test_replica.py):

    w  worker id            e  epoch: 16 hex digits, new on every full rewrite of the set
    s  sequence number      k  stored | removed | cleared | reset | left
    h  block hashes, packed unsigned 64-bit little-endian (stored / removed only)
    m  medium (stored / removed only): absent or `device`, `host`, `disk`

A worker's KV cache has tiers (`Medium`): its device pool, a host-memory tier and a disk tier.
`stored` with medium M: these blocks are now held in tier M; `removed` with medium M: no longer
in tier M. A block moved down a tier is `stored(host)` then `removed(device)`: it stays held by
the worker throughout. `cleared` clears every tier. An entry without `m` (workers before tiers)
is a device entry; a device entry is written without `m`, so it is byte-identical to theirs.

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
Medium = Literal["device", "host", "disk"]
MEDIA: tuple[Medium, ...] = ("device", "host", "disk")  # fastest first
_MEDIUM_FIELDS = {b"device": "device", b"host": "host", b"disk": "disk"}
EntryKind = Literal["stored", "removed", "cleared", "reset", "left"]

ENTRY_KINDS = frozenset(("stored", "removed", "cleared", "reset", "left"))
MAX_HASHES_PER_ENTRY = 1 << 16
_EPOCH = re.compile(rb"^[0-9a-f]{16}$")
WORKER_ID_PATTERN = r"^[A-Za-z0-9._:\[\]\-]{1,128}$"  # no braces: ids sit inside hash tags
_WORKER_ID = re.compile(WORKER_ID_PATTERN.encode())


@dataclass(frozen=True)
class BlockEvent:
    """What a worker's cache did: `medium` is the tier of a `stored` or `removed` (ignored for
    `cleared`, which empties every tier)."""

    kind: EventKind
    block_hashes: tuple[int, ...] = ()
    medium: Medium = "device"


@dataclass(frozen=True)
class StreamEntry:
    """One entry of an `events:{shard}` stream."""

    worker_id: str
    epoch: str
    seq: int
    kind: EntryKind
    block_hashes: tuple[int, ...] = ()
    medium: Medium = "device"

    def fields(self) -> dict[str, bytes]:
        packed = struct.pack(f"<{len(self.block_hashes)}Q", *self.block_hashes)
        out = {"w": self.worker_id.encode(), "e": self.epoch.encode(),
               "s": str(self.seq).encode(), "k": self.kind.encode(), "h": packed}
        if self.medium != "device":  # device entries stay as before tiers: `m` absent
            out["m"] = self.medium.encode()
        return out

    @classmethod
    def parse(cls, raw: dict[bytes, bytes]) -> StreamEntry:
        """Read one entry as XREAD returns it; anything malformed or out of bounds raises
        ValueError (the stream is written by workers, but Redis is not trusted with shapes)."""
        w, e, s, k, h, m = (raw.get(f) for f in (b"w", b"e", b"s", b"k", b"h", b"m"))
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
        medium = "device" if m is None else _MEDIUM_FIELDS.get(m)
        if medium is None:
            raise ValueError(f"bad medium {m[:32]!r}")
        hashes = struct.unpack(f"<{len(h) // 8}Q", h)
        return cls(w.decode(), e.decode(), int(s), kind, hashes, medium)  # type: ignore[arg-type]
