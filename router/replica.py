"""The router's own copy of every worker's block set, so a prefix lookup never leaves the process.

Fed by router/replica_feed.py from the workers' event streams, with Redis as the source of truth
(a worker's set is re-read whenever the stream cannot be trusted). Consistency rules:

- A stale replica can only misplace a request (a cache miss, or a worker picked for blocks it no
  longer has), never change an answer: workers compute whatever blocks they lack.
- Only the workers a lookup names are counted, and the router names live workers only, so a dead
  worker drops out of routing with the directory, whatever the replica still holds for it.

Layout: `holders` maps a block hash to a bit mask of the workers holding it on their device (one
bit per worker, recycled when a worker leaves), so one dictionary probe answers for every worker
at once. The lower tiers (host, disk) have maps of their own, empty while no worker has tiers, so
a fleet without them pays nothing for them: a block is held by a worker while any tier of it
holds it (a move down a tier is a `stored` in the lower one, then a `removed` in the upper one).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from common.block_events import Medium
from router.tiered_match import MatchByMedium, split_run

SEARCHES = ("gallop", "exact")
LOWER_TIERS: tuple[Medium, ...] = ("host", "disk")


class BlockReplica:
    def __init__(self) -> None:
        self._bits: dict[str, int] = {}  # worker id -> its bit (a power of two)
        self._free: list[int] = []
        self._next = 0
        self.holders: dict[int, int] = {}  # block hash -> mask of holders (device)
        self._held: dict[str, set[int]] = {}  # worker id -> its block hashes (device)
        # The same per lower tier: medium -> block hash -> mask, medium -> worker id -> hashes.
        self._tier_holders: dict[str, dict[int, int]] = {m: {} for m in LOWER_TIERS}
        self._tier_held: dict[str, dict[str, set[int]]] = {m: {} for m in LOWER_TIERS}

    # ---- updates ---------------------------------------------------------------------------

    def workers(self) -> set[str]:
        return set(self._bits)

    def num_blocks(self, worker_id: str, medium: Medium = "device") -> int:
        return len(self._maps(medium)[1].get(worker_id, ()))

    def held(self, worker_id: str, medium: Medium = "device") -> set[int]:
        """The hashes the worker holds in tier `medium` (a copy)."""
        return set(self._maps(medium)[1].get(worker_id, ()))

    def _maps(self, medium: str) -> tuple[dict[int, int], dict[str, set[int]]]:
        if medium == "device":
            return self.holders, self._held
        return self._tier_holders[medium], self._tier_held[medium]

    def add(self, worker_id: str, block_hashes: Iterable[int], medium: Medium = "device") -> None:
        bit = self._bit(worker_id)
        holders, by_worker = self._maps(medium)
        held = by_worker.setdefault(worker_id, set())
        for h in block_hashes:
            if h not in held:
                held.add(h)
                holders[h] = holders.get(h, 0) | bit

    def remove(self, worker_id: str, block_hashes: Iterable[int],
               medium: Medium = "device") -> None:
        bit = self._bits.get(worker_id)
        holders, by_worker = self._maps(medium)
        held = by_worker.get(worker_id)
        if bit is None or held is None:
            return
        for h in block_hashes:
            if h in held:
                held.discard(h)
                mask = holders[h] & ~bit
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]

    def clear(self, worker_id: str) -> None:
        """Every tier of the worker emptied."""
        if worker_id in self._held:
            self.remove(worker_id, list(self._held[worker_id]))
        for medium in LOWER_TIERS:
            held = self._tier_held[medium].get(worker_id)
            if held is not None:
                self.remove(worker_id, list(held), medium)
                del self._tier_held[medium][worker_id]

    def replace(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """The worker's whole device set (and no tier below), as just read from Redis."""
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
        bits, candidates = self._candidates(worker_ids)
        if not candidates or not block_hashes:
            return out
        counts = self._search(search, block_hashes, candidates, self.holders.get)
        for w, bit in bits.items():
            out[w] = counts.get(bit, 0)
        return out

    def _candidates(self, worker_ids: list[str]) -> tuple[dict[str, int], int]:
        """Each known worker's bit, and all of them OR-ed: the holders a search may report."""
        bits = {w: self._bits[w] for w in worker_ids if w in self._bits}
        candidates = 0
        for bit in bits.values():
            candidates |= bit
        return bits, candidates

    def match_by_medium(self, block_hashes: list[int], worker_ids: list[str],
                        search: str = "gallop") -> dict[str, MatchByMedium]:
        """Each worker's leading run held in any tier, split by the fastest tier holding each
        block (router/tiered_match.py); `search` as for `match`. Workers without tiers cost what
        `match` does; a worker with some costs a pass over its run besides."""
        host, disk = (self._tier_holders[m] for m in LOWER_TIERS)
        if not host and not disk:
            return {w: MatchByMedium(n) for w, n in self.match(block_hashes, worker_ids,
                                                                 search).items()}
        out = dict.fromkeys(worker_ids, MatchByMedium())
        bits, candidates = self._candidates(worker_ids)
        if not candidates or not block_hashes:
            return out
        device = self.holders

        def anywhere(h: int, default: int = 0) -> int:
            return device.get(h, 0) | host.get(h, 0) | disk.get(h, 0)

        counts = self._search(search, block_hashes, candidates, anywhere)
        for w, bit in bits.items():
            n = counts.get(bit, 0)
            if any(self._tier_held[m].get(w) for m in LOWER_TIERS):
                tiers = self._tier_held
                out[w] = split_run(block_hashes[:n], self._held[w], tiers["host"].get(w, ()),
                                   tiers["disk"].get(w, ()))
            else:
                out[w] = MatchByMedium(n)
        return out

    def _search(self, search: str, block_hashes: list[int], mask: int,
                get: Callable[[int, int], int]) -> dict[int, int]:
        if search == "exact":
            return self._exact(block_hashes, mask, get)
        if search == "gallop":
            return self._gallop(block_hashes, mask, get)
        raise ValueError(f"unknown index search {search!r}; choose from {', '.join(SEARCHES)}")

    def _exact(self, block_hashes: list[int], mask: int,
               get: Callable[[int, int], int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for i, h in enumerate(block_hashes):
            still = mask & get(h, 0)
            if still != mask:
                _assign(counts, mask & ~still, i)
                mask = still
                if not mask:
                    return counts
        _assign(counts, mask, len(block_hashes))
        return counts

    def _gallop(self, block_hashes: list[int], mask: int,
                get: Callable[[int, int], int]) -> dict[int, int]:
        # Position -1 is held by every candidate and position n by none. Between two probed
        # positions lo < hi with holder masks m_lo ⊇ m_hi, the workers in m_lo but not m_hi have
        # their last held block in [lo, hi); split until the interval is one block wide.
        counts: dict[int, int] = {}
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
        total = 0
        for holders, by_worker in map(self._maps, ("device", *LOWER_TIERS)):
            total += sys.getsizeof(holders) + 32 * len(holders)  # key + mask objects
            total += sum(sys.getsizeof(held) for held in by_worker.values())
        return total

    def num_entries(self) -> int:
        """(block, worker, tier) triples held."""
        return sum(len(h) for _, by_worker in map(self._maps, ("device", *LOWER_TIERS))
                   for h in by_worker.values())


def _assign(counts: dict[int, int], mask: int, n: int) -> None:
    while mask:
        low = mask & -mask
        counts[low] = n
        mask ^= low
