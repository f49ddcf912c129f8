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

from collections import OrderedDict

from router.replica import BlockReplica
from router.tiered_match import MatchByMedium

# --tiers: none below the device (today's worker), a host tier, a host and a disk tier, and no
# tier but a device cache without bound (the ceiling: what the workload could reuse at most).
TIERS = ("off", "host", "host+disk", "unbounded")


class FleetCache:
    def __init__(self, capacity_blocks: int | None, host_blocks: int = 0,
                 disk_blocks: int = 0) -> None:
        """`capacity_blocks` per worker's device (None: without bound); `host_blocks` and
        `disk_blocks` its lower tiers' (0: no such tier)."""
        self.capacity = capacity_blocks
        self.replica = BlockReplica()
        self._order: dict[str, OrderedDict[int, None]] = {}
        self.lower = tuple((m, n) for m, n in (("host", host_blocks), ("disk", disk_blocks)) if n)
        self._lower_order: dict[str, dict[str, OrderedDict[int, None]]] = {}

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

    def num_blocks(self, worker_id: str, medium: str = "device") -> int:
        """Blocks the worker holds in tier `medium` now."""
        if medium == "device":
            return len(self._order.get(worker_id, ()))
        return len(self._lower_order.get(worker_id, {}).get(medium, ()))

    def record(self, worker_id: str, block_hashes: list[int]) -> int:
        """The worker stored these blocks on its device (most recent last); returns how many
        blocks that pushed down into its host tier (offloads)."""
        order = self._order.setdefault(worker_id, OrderedDict())
        if self.tiered:
            self._promote(worker_id, block_hashes)
        _touch(order, block_hashes)
        self.replica.add(worker_id, block_hashes)
        excess = len(order) - self.capacity if self.capacity is not None else 0
        if excess <= 0:
            return 0
        evicted = [order.popitem(last=False)[0] for _ in range(excess)]
        offloaded = self._demote(worker_id, evicted, 0) if self.tiered else 0
        self.replica.remove(worker_id, evicted)
        return offloaded

    def _promote(self, worker_id: str, block_hashes: list[int]) -> None:
        for medium, order in self._lower_order.get(worker_id, {}).items():
            back = [h for h in block_hashes if h in order]
            for h in back:
                del order[h]
            if back:
                self.replica.remove(worker_id, back, medium)

    def _demote(self, worker_id: str, block_hashes: list[int], level: int) -> int:
        """`block_hashes` leave the tier above `self.lower[level]` into it; what overflows it
        goes down the next (the last one drops it). Returns how many it took in."""
        if level >= len(self.lower):
            return 0
        medium, capacity = self.lower[level]
        order = self._lower_order.setdefault(worker_id, {}).setdefault(medium, OrderedDict())
        _touch(order, block_hashes)
        self.replica.add(worker_id, block_hashes, medium)
        excess = len(order) - capacity
        if excess > 0:
            evicted = [order.popitem(last=False)[0] for _ in range(excess)]
            self._demote(worker_id, evicted, level + 1)
            self.replica.remove(worker_id, evicted, medium)
        return len(block_hashes)

    def match(self, block_hashes: list[int], worker_ids: list[str],
              search: str = "gallop") -> dict[str, int]:
        """The router's view (gallop, as it routes); `exact` for what a worker really holds."""
        return self.replica.match(block_hashes, worker_ids, search)

    def match_by_medium(self, block_hashes: list[int], worker_ids: list[str],
                        search: str = "gallop") -> dict[str, MatchByMedium]:
        """Each worker's leading run in any tier, split by tier (router/tiered_match.py)."""
        return self.replica.match_by_medium(block_hashes, worker_ids, search)

    def held(self, worker_id: str, block_hashes: list[int]) -> MatchByMedium:
        """What `worker_id` really holds of the prompt's leading blocks, by tier."""
        if not self.tiered:
            return MatchByMedium(self.match(block_hashes, [worker_id], "exact")[worker_id])
        return self.match_by_medium(block_hashes, [worker_id], "exact")[worker_id]


def _touch(order: OrderedDict[int, None], block_hashes: list[int]) -> None:
    """Each hash becomes the most recently stored, in turn."""
    move = order.move_to_end
    for h in block_hashes:
        if h in order:
            move(h)
        else:
            order[h] = None
