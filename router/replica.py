"""The router's own copy of every worker's block set, so a prefix lookup never leaves the process.

Fed by router/replica_feed.py from the workers' event streams, with Redis as the source of truth
(a worker's set is re-read whenever the stream cannot be trusted). Consistency rules:

- A stale replica can only misplace a request (a cache miss, or a worker picked for blocks it no
  longer has), never change an answer: workers compute whatever blocks they lack.
- Only the workers a lookup names are counted, and the router names live workers only, so a dead
  worker drops out of routing with the directory, whatever the replica still holds for it.

Layout: `holders` maps a block hash to a bit mask of the workers holding it (one bit per worker,
recycled when a worker leaves), so one dictionary probe answers for every worker at once.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

SEARCHES = ("gallop", "exact")


class BlockReplica:
    def __init__(self) -> None:
        self._bits: dict[str, int] = {}  # worker id -> its bit (a power of two)
        self._free: list[int] = []
        self._next = 0
        self.holders: dict[int, int] = {}  # block hash -> mask of holders
        self._held: dict[str, set[int]] = {}  # worker id -> its block hashes

    # ---- updates ---------------------------------------------------------------------------

    def workers(self) -> set[str]:
        return set(self._bits)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def add(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        bit = self._bit(worker_id)
        held, holders = self._held[worker_id], self.holders
        for h in block_hashes:
            if h not in held:
                held.add(h)
                holders[h] = holders.get(h, 0) | bit

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        bit = self._bits.get(worker_id)
        if bit is None:
            return
        held, holders = self._held[worker_id], self.holders
        for h in block_hashes:
            if h in held:
                held.discard(h)
                mask = holders[h] & ~bit
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]

    def clear(self, worker_id: str) -> None:
        if worker_id in self._held:
            self.remove(worker_id, list(self._held[worker_id]))

    def replace(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """The worker's whole set, as just read from Redis."""
        self.clear(worker_id)
        self.add(worker_id, block_hashes)

    def drop(self, worker_id: str) -> None:
        """The worker left: its entries go, and its bit is free for a newcomer."""
        self.clear(worker_id)
        bit = self._bits.pop(worker_id, None)
        if bit is not None:
            del self._held[worker_id]
            self._free.append(bit)

    def _bit(self, worker_id: str) -> int:
        bit = self._bits.get(worker_id)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                bit, self._next = 1 << self._next, self._next + 1
            self._bits[worker_id] = bit
            self._held[worker_id] = set()
        return bit

    # ---- lookups ---------------------------------------------------------------------------

    def match(self, block_hashes: list[int], worker_ids: list[str],
              search: str = "gallop") -> dict[str, int]:
        """Leading matched blocks per worker id (0 for unknown workers).

        `exact` walks the prompt until every candidate has missed: O(longest match). `gallop`
        bisects all workers at once, O(distinct match lengths × log n): it assumes a worker's
        blocks of one chain form a prefix (what the workers' tail-first eviction keeps true),
        like the Redis script of the same name, and where one does not it may count wrongly,
        which costs a cache miss, never a wrong answer."""
        out = dict.fromkeys(worker_ids, 0)
        bits = {w: self._bits[w] for w in worker_ids if w in self._bits}
        candidates = 0
        for bit in bits.values():
            candidates |= bit
        if not candidates or not block_hashes:
            return out
        if search == "exact":
            counts = self._exact(block_hashes, candidates)
        elif search == "gallop":
            counts = self._gallop(block_hashes, candidates)
        else:
            raise ValueError(f"unknown index search {search!r}; choose from {', '.join(SEARCHES)}")
        for w, bit in bits.items():
            out[w] = counts.get(bit, 0)
        return out

    def _exact(self, block_hashes: list[int], mask: int) -> dict[int, int]:
        counts: dict[int, int] = {}
        get = self.holders.get
        for i, h in enumerate(block_hashes):
            still = mask & get(h, 0)
            if still != mask:
                _assign(counts, mask & ~still, i)
                mask = still
                if not mask:
                    return counts
        _assign(counts, mask, len(block_hashes))
        return counts

    def _gallop(self, block_hashes: list[int], mask: int) -> dict[int, int]:
        # Position -1 is held by every candidate and position n by none. Between two probed
        # positions lo < hi with holder masks m_lo ⊇ m_hi, the workers in m_lo but not m_hi have
        # their last held block in [lo, hi); split until the interval is one block wide.
        counts: dict[int, int] = {}
        get = self.holders.get
        stack = [(-1, len(block_hashes), mask, 0)]
        while stack:
            lo, hi, m_lo, m_hi = stack.pop()
            if m_lo == m_hi:
                continue
            diff = m_lo & ~m_hi
            if diff & (diff - 1) == 0:  # one worker changes in here: a plain binary search
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    if get(block_hashes[mid], 0) & diff:
                        lo = mid
                    else:
                        hi = mid
                counts[diff] = lo + 1
                continue
            if hi - lo == 1:
                _assign(counts, diff, lo + 1)
                continue
            mid = (lo + hi) // 2
            m_mid = (get(block_hashes[mid], 0) & m_lo) | m_hi
            stack.append((mid, hi, m_mid, m_hi))
            stack.append((lo, mid, m_lo, m_mid))
        return counts

    # ---- size ------------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Approximate bytes held: the holders map, every worker's set, and the ints in them."""
        total = sys.getsizeof(self.holders) + 32 * len(self.holders)  # key + mask objects
        for held in self._held.values():
            total += sys.getsizeof(held)
        return total

    def num_entries(self) -> int:
        """(block, worker) pairs held."""
        return sum(len(h) for h in self._held.values())


def _assign(counts: dict[int, int], mask: int, n: int) -> None:
    while mask:
        low = mask & -mask
        counts[low] = n
        mask ^= low
