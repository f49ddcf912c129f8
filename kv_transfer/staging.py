"""`StagingPool`: a bounded region of whole-block slots beside the KV cache, leased in contiguous
ranges like blocks are leased for export.

A scattered pull pays one transfer descriptor per run of blocks (~7 us each on cuda_ipc: 255
descriptors held 256 blocks to 5% of the link). Staged, the sender's blocks are gathered into one
range of slots when they are exported (off the critical path) and the receiver READs one
descriptor into its own slots and scatters them with the CUDA kernel (kv_transfer/pull_plan.py
decides when). The region is allocated and registered once; a lease is a (start, count) range
owned by a request id and is given back on every path (notification, expiry, cancel, failure).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from kv_transfer import kernels
from kv_transfer.side_stream import SideStream


@dataclass(frozen=True)
class StagingLease:
    owner: str
    start: int  # first slot
    num_blocks: int


class StagingPool:
    def __init__(self, cache: torch.Tensor, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a staging pool needs at least one slot")
        # [num_slots, L, 2, BS, H, D]: a slot holds one block, in the cache's dtype and device.
        self.buffer = torch.empty((num_slots, *cache.shape[1:]), dtype=cache.dtype,
                                  device=cache.device)
        self.num_slots = num_slots
        self._free: list[tuple[int, int]] = [(0, num_slots)]  # sorted (start, length), merged
        self._leases: dict[str, StagingLease] = {}

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def __contains__(self, owner: str) -> bool:
        return owner in self._leases

    @property
    def num_leased_slots(self) -> int:
        return self.num_slots - sum(length for _, length in self._free)

    def lease(self, owner: str, num_blocks: int) -> StagingLease | None:
        """A contiguous range of `num_blocks` slots for `owner` (first fit), or None when no free
        range is that long: the caller then moves the blocks without staging."""
        if owner in self._leases:
            raise ValueError(f"{owner!r} already holds staging slots")
        if num_blocks < 1:
            raise ValueError("a staging lease needs at least one slot")
        for i, (start, length) in enumerate(self._free):
            if length >= num_blocks:
                if length == num_blocks:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_blocks, length - num_blocks)
                lease = StagingLease(owner, start, num_blocks)
                self._leases[owner] = lease
                return lease
        return None

    def get(self, owner: str) -> StagingLease | None:
        return self._leases.get(owner)

    def release(self, owner: str) -> bool:
        """Give `owner`'s slots back (merged with free neighbours); False if it held none."""
        lease = self._leases.pop(owner, None)
        if lease is None:
            return False
        i = bisect.bisect_left(self._free, (lease.start, 0))
        start, length = lease.start, lease.num_blocks
        if i < len(self._free) and self._free[i][0] == start + length:  # merge the right neighbour
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the left one
            start, length = self._free[i - 1][0], self._free[i - 1][1] + length
            i -= 1
            self._free.pop(i)
        self._free.insert(i, (start, length))
        return True

    def view(self, lease: StagingLease) -> torch.Tensor:
        """The lease's slots: [num_blocks, L, 2, BS, H, D], contiguous."""
        return self.buffer[lease.start: lease.start + lease.num_blocks]

    def stage(self, owner: str, cache: torch.Tensor, block_ids: list[int],
              side: SideStream) -> int | None:
        """Lease slots for `owner` and gather `block_ids` of `cache` into them (on `side`, waited
        for: a READ may come at once); the first slot, or None when no range is free. The slots
        are given back if the gather fails."""
        lease = self.lease(owner, len(block_ids))
        if lease is None:
            return None  # full: this export is read block by block
        try:
            with side:
                kernels.gather_blocks(cache, block_ids, out=self.view(lease))
            side.synchronize()  # ~50 us for 256 blocks
        except BaseException:
            self.release(owner)
            raise
        return lease.start
