"""FIFO queues bounded in bytes, between the ZMQ sockets and whoever reads them
(vllm_bridge/link.py).

ZMQ bounds its queues in messages only (RCVHWM), each message up to MAXMSGSIZE per frame: a peer
that sends large batches faster than the bridge decodes them made it hold up to 10,000 x 64 MiB
(issue 38 item 6). The link keeps ZMQ's own queues tiny and drains its sockets at once into
these queues instead; their items together never hold more than one `ByteBudget`. What does not
fit is refused (`put` answers False) and the caller drops and counts it: a dropped batch is a
gap in the seqs, which the subscriber fills by replay or resets on, as any other gap.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")
# What an item costs beyond the bytes it is said to hold (its tuple, its bytes object, the slot):
# counted too, or a flood of 1-byte batches would cost 200 times its budget.
ITEM_OVERHEAD_BYTES = 256


class ByteBudget:
    """The bytes that every queue sharing it may hold together."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.used = 0


class ByteQueue(Generic[T]):
    """Items of a stated size in bytes, oldest first, within `budget`; one event loop only.
    Markers (`put_marker`: a reconnect, the end of an answer) hold no bytes and always fit."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self._items: deque[tuple[T, int]] = deque()
        self._ready = asyncio.Event()

    def put(self, item: T, num_bytes: int) -> bool:
        """Queue `item` if its bytes fit in the budget, or the budget holds nothing (one item
        always fits); False (nothing queued) if not."""
        num_bytes += ITEM_OVERHEAD_BYTES
        if self.budget.used and self.budget.used + num_bytes > self.budget.max_bytes:
            return False
        self.budget.used += num_bytes
        self._items.append((item, num_bytes))
        self._ready.set()
        return True

    def put_marker(self, item: T) -> None:
        self._items.append((item, 0))
        self._ready.set()

    def last(self) -> T | None:
        return self._items[-1][0] if self._items else None

    async def get(self) -> T:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item, num_bytes = self._items.popleft()
        self.budget.used -= num_bytes
        return item

    def clear(self) -> None:
        """Drop everything queued, giving its bytes back to the budget."""
        self.budget.used -= sum(n for _, n in self._items)
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
