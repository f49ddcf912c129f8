"""What the simulated router knows of every worker's prefix cache: the router's own replica
(router/replica.py, the same searches and the same bit-mask layout), fed when a simulated
worker stores blocks, with each worker's capacity enforced least-recently-stored first, as its
block pool evicts. A lookup over 1,024 workers and a 100k-token prompt costs what it costs in a
real router, so the sweep can model fleets of that size."""

from __future__ import annotations

from collections import OrderedDict

from router.replica import BlockReplica


class FleetCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.replica = BlockReplica()
        self._order: dict[str, OrderedDict[int, None]] = {}

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        order = self._order.setdefault(worker_id, OrderedDict())
        for h in block_hashes:
            order.pop(h, None)
            order[h] = None
        self.replica.add(worker_id, block_hashes)
        excess = len(order) - self.capacity
        if excess > 0:
            evicted = [order.popitem(last=False)[0] for _ in range(excess)]
            self.replica.remove(worker_id, evicted)

    def match(self, block_hashes: list[int], worker_ids: list[str],
              search: str = "gallop") -> dict[str, int]:
        """The router's view (gallop, as it routes); `exact` for what a worker really holds."""
        return self.replica.match(block_hashes, worker_ids, search)
