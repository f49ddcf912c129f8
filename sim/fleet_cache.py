"""What the simulated router knows of every worker's prefix cache: the router's own replica
(router/replica.py, the same searches and the same bit-mask layout), fed when a simulated
worker stores blocks, with each worker's capacity enforced least-recently-stored first, as its
block pool evicts. A lookup over 1,024 workers and a 100k-token prompt costs what it costs in a
real router, so the sweep can model fleets of that size.

With KV tiers (`TIERS`), a block the device evicts moves to the worker's host tier,
and one the host tier evicts to its disk tier (each bounded, least recently stored first; what
the last tier evicts is gone), as the engine's tiers (engine/kv_tiers.py) move them and publish
the moves: a `stored` in the lower tier, then a `removed` in the upper one. A block stored again
(prefilled, reloaded, or imported) is a device block again and leaves the lower tier.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, islice, repeat, takewhile
from operator import eq

from router.replica import BlockReplica
from router.tiered_match import MatchByMedium

# --tiers: none below the device (today's worker), a host tier, a host and a disk tier, and no
# tier but a device cache without bound (the ceiling: what the workload could reuse at most).
TIERS = ("off", "host", "host+disk", "unbounded")


class StoreOrder:
    """One worker's blocks in one tier, least recently stored first (what its pool evicts
    first), at a dictionary entry a block: each hash maps to the stamp of the last batch that
    stored it, and the batches wait in a queue; evicting walks the oldest batch, skipping the
    hashes stored again since (or gone). The order is an ordered dict's with every stored hash
    moved to the end, for batches without repeats (a chain's)."""

    __slots__ = ("last", "_batches", "_at", "_stamp")

    def __init__(self, bounded: bool = True) -> None:
        """`bounded=False`: nothing is ever evicted here, so no order is kept."""
        self.last: dict[int, int] = {}  # block hash -> the stamp of the batch that stored it
        # (stamp, its hashes), oldest first
        self._batches: deque[tuple[int, list[int]]] | None = deque() if bounded else None
        self._at = 0  # how far the oldest batch has been walked
        self._stamp = 0

    def __len__(self) -> int:
        return len(self.last)

    def store(self, block_hashes: list[int]) -> None:
        """Each hash becomes the most recently stored, in turn (the list is kept: not to be
        changed after)."""
        self._stamp += 1
        self.last.update(dict.fromkeys(block_hashes, self._stamp))
        if self._batches is not None:
            self._batches.append((self._stamp, block_hashes))

    def pop_oldest(self, n: int) -> list[int]:
        """The `n` least recently stored, oldest first, taken out."""
        out: list[int] = []
        last, batches = self.last, self._batches
        while len(out) < n:
            stamp, hashes = batches[0]
            # The next hashes of the oldest batch, less those stored again since or gone (in
            # C: map, compress and deque, not a Python loop over thousands of blocks).
            chunk = hashes[self._at:self._at + n - len(out)]
            stamps = list(map(last.get, chunk))
            if stamps.count(stamp) != len(chunk):
                chunk = list(compress(chunk, map(eq, stamps, repeat(stamp))))
            deque(map(last.__delitem__, chunk), maxlen=0)
            out += chunk
            self._at += len(stamps)
            if self._at >= len(hashes):
                batches.popleft()
                self._at = 0
        return out

    def discard(self, block_hashes: list[int]) -> list[int]:
        """Takes out those of `block_hashes` held here; returns them (in no order)."""
        gone = list(self.last.keys() & block_hashes)
        deque(map(self.last.__delitem__, gone), maxlen=0)
        return gone


class FleetCache:
    def __init__(self, capacity_blocks: int | None, host_blocks: int = 0,
                 disk_blocks: int = 0) -> None:
        """`capacity_blocks` per worker's device (None: without bound); `host_blocks` and
        `disk_blocks` its lower tiers' (0: no such tier)."""
        self.capacity = capacity_blocks
        self.replica = BlockReplica()
        self.lower = tuple((m, n) for m, n in (("host", host_blocks), ("disk", disk_blocks)) if n)
        # worker id -> medium -> its blocks there, in store order (device first)
        self._tiers: dict[str, dict[str, StoreOrder]] = {}

    @classmethod
    def for_tiers(cls, tiers: str, num_blocks: int, host_blocks: int,
                  disk_blocks: int) -> FleetCache:
        """The fleet's caches for one `TIERS` setting, from a profile's capacities."""
        if tiers not in TIERS:
            raise ValueError(f"unknown tiers {tiers!r}; choose from {', '.join(TIERS)}")
        if tiers in ("host", "host+disk") and not host_blocks:
            raise ValueError(f"--tiers {tiers} needs the profile's host_blocks")
        if tiers == "host+disk" and not disk_blocks:
            raise ValueError("--tiers host+disk needs the profile's disk_blocks")
        return cls(None if tiers == "unbounded" else num_blocks,
                   host_blocks if tiers in ("host", "host+disk") else 0,
                   disk_blocks if tiers == "host+disk" else 0)

    @property
    def tiered(self) -> bool:
        return bool(self.lower)

    def _orders(self, worker_id: str) -> dict[str, StoreOrder]:
        orders = self._tiers.get(worker_id)
        if orders is None:
            orders = {"device": StoreOrder(bounded=self.capacity is not None)}
            orders.update((m, StoreOrder()) for m, _ in self.lower)
            self._tiers[worker_id] = orders
        return orders

    def num_blocks(self, worker_id: str, medium: str = "device") -> int:
        """Blocks the worker holds in tier `medium` now."""
        order = self._tiers.get(worker_id, {}).get(medium)
        return len(order) if order is not None else 0

    def record(self, worker_id: str, block_hashes: list[int]) -> int:
        """The worker stored these blocks on its device (most recent last); returns how many
        blocks that pushed down into its host tier (offloads)."""
        orders = self._orders(worker_id)
        if self.tiered:
            self._promote(worker_id, orders, block_hashes)
        device = orders["device"]
        device.store(block_hashes)
        self.replica.add(worker_id, block_hashes)
        excess = len(device) - self.capacity if self.capacity is not None else 0
        if excess <= 0:
            return 0
        evicted = device.pop_oldest(excess)
        offloaded = self._demote(worker_id, orders, evicted, 0) if self.tiered else 0
        self.replica.remove(worker_id, evicted)
        return offloaded

    def _promote(self, worker_id: str, orders: dict[str, StoreOrder],
                 block_hashes: list[int]) -> None:
        for medium, _ in self.lower:
            order = orders[medium]
            back = order.discard(block_hashes) if len(order) else None
            if back:
                self.replica.remove(worker_id, back, medium)

    def _demote(self, worker_id: str, orders: dict[str, StoreOrder], block_hashes: list[int],
                level: int) -> int:
        """`block_hashes` leave the tier above `self.lower[level]` into it; what overflows it
        goes down the next (the last one drops it). Returns how many it took in."""
        if level >= len(self.lower):
            return 0
        medium, capacity = self.lower[level]
        order = orders[medium]
        order.store(block_hashes)
        self.replica.add(worker_id, block_hashes, medium)
        excess = len(order) - capacity
        if excess > 0:
            evicted = order.pop_oldest(excess)
            self._demote(worker_id, orders, evicted, level + 1)
            self.replica.remove(worker_id, evicted, medium)
        return len(block_hashes)

    def match(self, block_hashes: list[int], worker_ids: list[str], search: str = "gallop",
              *, only_matched: bool = False) -> dict[str, int]:
        """The router's view (gallop, as it routes); `exact` for what a worker really holds."""
        return self.replica.match(block_hashes, worker_ids, search, only_matched=only_matched)

    def match_by_medium(self, block_hashes: list[int], worker_ids: list[str],
                        search: str = "gallop", *,
                        only_matched: bool = False) -> dict[str, MatchByMedium]:
        """Each worker's leading run in any tier, split by tier (router/tiered_match.py)."""
        return self.replica.match_by_medium(block_hashes, worker_ids, search,
                                            only_matched=only_matched)

    def held(self, worker_id: str, block_hashes: list[int]) -> MatchByMedium:
        """What `worker_id` really holds of the prompt's leading blocks, by tier: the replica's
        exact search, read off the worker's own tiers run by run (a block is in one tier)."""
        orders = self._tiers.get(worker_id)
        if orders is None:
            return MatchByMedium()
        tiers = [orders[m].last if m in orders else {} for m in ("device", "host", "disk")]
        counts, i = [0, 0, 0], 0
        while i < len(block_hashes):
            h = block_hashes[i]
            at = next((t for t, tier in enumerate(tiers) if h in tier), None)
            if at is None:
                break
            run = len(list(takewhile(tiers[at].__contains__, islice(block_hashes, i, None))))
            counts[at] += run
            i += run
        return MatchByMedium(*counts)
