"""Where the TCP transport's payload bytes live: a list of memory regions read or written in
order, and the pieces of them that one checksummed chunk covers.

On a CPU cache the regions are the blocks themselves (each block is one contiguous run, see
kv_transfer/layout.py): the sender sends straight from its cache and the receiver receives
straight into its own blocks, so the only copies are the kernel's. A GPU cache, or fp8 packing,
goes through one staging buffer instead.
"""

from __future__ import annotations

import bisect
from itertools import accumulate

import torch


def block_views(cache: torch.Tensor, block_ids: list[int]) -> list[memoryview]:
    """Writable byte views of `block_ids` of a CPU cache `[num_blocks, ...]`, in order."""
    flat = cache.view(torch.uint8).reshape(cache.shape[0], -1).numpy()  # [num_blocks, bytes]
    return [memoryview(flat[b]) for b in block_ids]


class Regions:
    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.starts = [0, *accumulate(len(v) for v in views)]  # offsets; the last is the total

    @property
    def num_bytes(self) -> int:
        return self.starts[-1]

    def pieces(self, start: int, end: int) -> list[memoryview]:
        """The slices of the regions that hold payload bytes [start, end)."""
        out = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            view, base = self.views[i], self.starts[i]
            stop = min(end, base + len(view))
            out.append(view[start - base : stop - base])
            start, i = stop, i + 1
        return out
