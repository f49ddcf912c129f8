"""Descriptor lists for block transfers: one (address, length) run per block, merged where
consecutive blocks are contiguous on both sides."""

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
    src_device_id: int = 0,
    dst_device_id: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (address, length, device) arrays for both sides, one row per run, in the same order.

    Offsets only depend on block ids (a block is one contiguous run), so the two regions may
    hold different numbers of blocks.
    """
    block = layout.bytes_per_block
    src = np.empty((len(runs), 3), dtype=np.uint64)
    dst = np.empty((len(runs), 3), dtype=np.uint64)
    src[:, 0] = [src_base + r.src_start * block for r in runs]
    dst[:, 0] = [dst_base + r.dst_start * block for r in runs]
    src[:, 1] = dst[:, 1] = [r.num_blocks * block for r in runs]
    src[:, 2] = src_device_id
    dst[:, 2] = dst_device_id
    return src, dst


def block_descriptors(layout: KVLayout, base: int, num_blocks: int,
                      device_id: int = 0) -> np.ndarray:
    """Nx3 (address, length, device), one row per block of a region: a prepared list that
    pulls index by block id (NIXL merges contiguous rows of a pull itself)."""
    block = layout.bytes_per_block
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block)
    descs[:, 1] = block
    descs[:, 2] = device_id
    return descs


def count_runs(src_block_ids, dst_block_ids=None) -> int:
    """How many runs `coalesce` would make (numpy, no per-block Python): the descriptor count of a
    transfer. Without `dst_block_ids` the destination is taken as contiguous."""
    src = np.asarray(src_block_ids, dtype=np.int64)
    if src.size == 0:
        return 0
    breaks = np.diff(src) != 1
    if dst_block_ids is not None:
        dst = np.asarray(dst_block_ids, dtype=np.int64)
        if dst.shape != src.shape:
            raise ValueError("source and destination block lists differ in length")
        breaks |= np.diff(dst) != 1
    return 1 + int(np.count_nonzero(breaks))
