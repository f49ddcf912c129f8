"""Descriptor lists for block transfers: one (offset, length) run per (layer, K/V, block), with
runs merged where consecutive blocks are contiguous on both sides."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class BlockRun:
    src_start: int  # first block id on the source side
    dst_start: int
    num_blocks: int


def coalesce(src_block_ids: list[int], dst_block_ids: list[int]) -> list[BlockRun]:
    """Group the (src, dst) block pairs into runs contiguous on both sides."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError("source and destination block lists differ in length")
    runs: list[BlockRun] = []
    for s, d in zip(src_block_ids, dst_block_ids, strict=True):
        if runs:
            last = runs[-1]
            if s == last.src_start + last.num_blocks and d == last.dst_start + last.num_blocks:
                runs[-1] = BlockRun(last.src_start, last.dst_start, last.num_blocks + 1)
                continue
        runs.append(BlockRun(s, d, 1))
    return runs


def descriptor_arrays(
    layout: KVLayout,
    src_base: int,
    dst_base: int,
    runs: list[BlockRun],
    src_num_blocks: int,
    dst_num_blocks: int,
    device_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (address, length, device) arrays for both sides, in the same order.

    The two regions may hold different numbers of blocks, so each side's offsets use its own
    `num_blocks`; run lengths are identical by construction.
    """
    run = layout.run_bytes
    n = layout.num_layers * 2 * len(runs)
    src = np.empty((n, 3), dtype=np.uint64)
    dst = np.empty((n, 3), dtype=np.uint64)
    starts_src = np.array([r.src_start for r in runs], dtype=np.uint64)
    starts_dst = np.array([r.dst_start for r in runs], dtype=np.uint64)
    lengths = np.array([r.num_blocks for r in runs], dtype=np.uint64) * run
    for half in range(layout.num_layers * 2):  # half = layer * 2 + kv
        rows = slice(half * len(runs), (half + 1) * len(runs))
        src[rows, 0] = src_base + (half * src_num_blocks + starts_src) * run
        dst[rows, 0] = dst_base + (half * dst_num_blocks + starts_dst) * run
        src[rows, 1] = lengths
        dst[rows, 1] = lengths
    src[:, 2] = device_id
    dst[:, 2] = device_id
    return src, dst
