"""What a worker's block pool tells the router's index (DESIGN.md "Redis schema"): blocks
stored, blocks removed, or everything cleared. Made by engine/block_pool.py, published by
common/registry.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class BlockEvent:
    kind: EventKind
    block_hashes: tuple[int, ...] = ()
