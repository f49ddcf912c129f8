"""The host tier: a bounded pool of KV block copies in host memory, by block hash, in LRU order.

One tensor of `num_slots` blocks is allocated up front (pinned when the KV cache is on a GPU, so
copies to and from it are DMA), so the tier's memory never exceeds its budget. Not thread-safe on
its own: `engine/kv_tiers.py` holds the lock.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        if num_slots < 1:
            raise ValueError("a host tier needs at least one slot")
        self.slab = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.num_slots = num_slots
        self.block_bytes = self.slab[0].numel() * self.slab.element_size()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    @property
    def used_bytes(self) -> int:
        return len(self._slots) * self.block_bytes

    def slot(self, block_hash: int) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, block_hash: int) -> None:
        """Make `block_hash` the most recently used."""
        self._slots.move_to_end(block_hash)

    def take_slot(self) -> int | None:
        """A slot nobody holds, for a copy about to be made; None when every slot is held."""
        return self._free.pop() if self._free else None

    def put(self, block_hash: int, slot: int) -> None:
        """`slot` (from `take_slot`) now holds `block_hash`."""
        self._slots[block_hash] = slot

    def evict_lru(self) -> tuple[int, int] | None:
        """Take the least recently used block out of the index: (its hash, its slot), which
        still holds its contents until the caller gives the slot back with `release_slot`."""
        if not self._slots:
            return None
        return self._slots.popitem(last=False)

    def release_slot(self, slot: int) -> None:
        self._free.append(slot)

    def hashes(self) -> list[int]:
        return list(self._slots)

    def clear(self) -> list[int]:
        """Forget every block; their hashes."""
        gone = list(self._slots)
        self._free.extend(self._slots.values())
        self._slots.clear()
        return gone
