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
from router.tiered_match import NO_MATCH, MatchByMedium, split_run

SEARCHES = ("gallop", "exact")
LOWER_TIERS: tuple[Medium, ...] = ("host", "disk")


class BlockReplica:
    def __init__(self) -> None:
        self._bits: dict[str, int] = {}  # worker id -> its bit (a power of two)
        self._by_bit: dict[int, str] = {}  # and back
        self._version = 0  # changes whenever a bit is given or freed
        self._last_candidates: tuple[tuple, int] = ((), 0)
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
        # Set arithmetic in C first: a worker re-storing blocks it holds (a decode worker caching
        # a sequence whose prompt it already has) costs no Python-level loop over them.
        new = set(block_hashes).difference(held)  # (walks the new list, not the held set)
        held.update(new)
        get = holders.get
        for h in new:
            holders[h] = get(h, 0) | bit

    def remove(self, worker_id: str, block_hashes: Iterable[int],
               medium: Medium = "device") -> None:
        bit = self._bits.get(worker_id)
        holders, by_worker = self._maps(medium)
        held = by_worker.get(worker_id)
        if bit is None or held is None:
            return
        gone = held.intersection(block_hashes)
        held.difference_update(gone)
        keep = ~bit
        for h in gone:
            mask = holders[h] & keep
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
            del self._by_bit[bit]
            self._free.append(bit)
            self._version += 1

    def _bit(self, worker_id: str) -> int:
        bit = self._bits.get(worker_id)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                bit, self._next = 1 << self._next, self._next + 1
            self._bits[worker_id] = bit
            self._by_bit[bit] = worker_id
            self._held[worker_id] = set()
            self._version += 1
        return bit

    # ---- lookups ---------------------------------------------------------------------------

    def match(self, block_hashes: list[int], worker_ids: list[str], search: str = "gallop",
              *, only_matched: bool = False) -> dict[str, int]:
        """Leading matched blocks per worker id (0 for unknown workers; `only_matched`: the
        workers with a match only, for a caller that reads the rest as 0).

        `exact` walks the prompt until every candidate has missed: O(longest match). `gallop`
        bisects all workers at once, O(distinct match lengths × log n): it assumes a worker's
        blocks of one chain form a prefix (what the workers' tail-first eviction keeps true),
        like the Redis script of the same name, and where one does not it may count wrongly,
        which costs a cache miss, never a wrong answer."""
        matched = self._matched(block_hashes, worker_ids, search, self.holders.get)
        if only_matched:
            return matched
        out = dict.fromkeys(worker_ids, 0)
        out.update(matched)
        return out

    def _matched(self, block_hashes: list[int], worker_ids: list[str], search: str,
                 get: Callable[[int, int], int]) -> dict[str, int]:
        """The workers among `worker_ids` with a leading match, and its length: a search over
        a thousand workers costs what their few holders cost, not a step per worker."""
        candidates = self._candidates(worker_ids)
        if not candidates or not block_hashes:
            return {}
        by_bit = self._by_bit
        return {by_bit[bit]: n for bit, n in self._search(search, block_hashes, candidates,
                                                           get).items()}

    def _candidates(self, worker_ids: list[str]) -> int:
        """The bits of the known workers among `worker_ids`, OR-ed: the holders a search may
        report (remembered for the last list asked about: a router asks about its live set)."""
        key = (self._version, tuple(worker_ids))
        if key != self._last_candidates[0]:
            mask = 0
            for w in worker_ids:
                mask |= self._bits.get(w, 0)
            self._last_candidates = (key, mask)
        return self._last_candidates[1]

    def match_by_medium(self, block_hashes: list[int], worker_ids: list[str],
                        search: str = "gallop", *,
                        only_matched: bool = False) -> dict[str, MatchByMedium]:
        """Each worker's leading run held in any tier, split by the fastest tier holding each
        block (router/tiered_match.py); `search` and `only_matched` as for `match`. Workers
        without tiers cost what `match` does; a worker with some costs a pass over its run
        besides."""
        out = {} if only_matched else dict.fromkeys(worker_ids, NO_MATCH)
        host, disk = (self._tier_holders[m] for m in LOWER_TIERS)
        if not host and not disk:
            matched = self._matched(block_hashes, worker_ids, search, self.holders.get)
            out.update((w, MatchByMedium(n)) for w, n in matched.items())
            return out
        device = self.holders

        def anywhere(h: int, default: int = 0) -> int:
            return device.get(h, 0) | host.get(h, 0) | disk.get(h, 0)

        tiers = self._tier_held
        for w, n in self._matched(block_hashes, worker_ids, search, anywhere).items():
            if any(tiers[m].get(w) for m in LOWER_TIERS):
                out[w] = split_run(block_hashes[:n], self._held[w], tiers["host"].get(w, ()),
                                   tiers["disk"].get(w, ()))
            else:
                out[w] = MatchByMedium(n)
        return out

    def _search(self, search: str, block_hashes: list[int], mask: int,
                get: Callable[[int, int], int]) -> dict[int, int]:
        """bit -> leading match of the workers in `mask` that have one (no zeros)."""
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
                if i:  # (a worker without the first block has no match: left out)
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
                if lo >= 0:  # (no match: left out)
                    counts[diff] = lo + 1
                continue
            if hi - lo == 1:
                if lo >= 0:
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
