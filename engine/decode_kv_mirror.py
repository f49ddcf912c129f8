"""The decode rows' keys and values kept contiguous between steps: the SDPA path's stand-in for
a paged kernel.

SDPA over the paged cache needs each decode row's context in one run of memory. Gathering it
from the blocks in every layer of every step reads and writes the whole context each time
(about an eighth of a CPU decode step at 4 × 250 tokens, docs/benchmarks.md). A sequence that
decoded in the step before gains exactly one token, so its gathered copy is kept here and only
the new token is written; a row is gathered again when its sequence joins the decode batch or
its blocks change, and every row when the buffers grow.

The cache stays the one truth. A row is reused only when the same sequence was a decode row of
the last step that completed, with the same blocks and exactly one token more now: the blocks
it holds were not freed in between, and the positions copied are never written again while it
holds them. What SDPA reads is then bit for bit what the gather reads
(tests/engine/test_decode_kv_mirror.py). Past a row's length the buffers hold zeros or an
earlier row's values, finite and masked, as the gather's padding blocks are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

MIN_KEYS = 256  # the buffers' first length in tokens; they grow by doubling


@dataclass
class _Row:
    seq: Sequence  # the sequence itself, not its id: ids can be reused, objects are kept alive
    num_tokens: int  # positions [0, num_tokens) hold the cache's values
    block_ids: list[int]  # the blocks those positions were copied from


@dataclass
class DecodeKVStep:
    """One step's use of the mirror, read by the attention layer by layer."""

    mirror: DecodeKVMirror
    num_rows: int
    num_keys: int  # keys attended per row: the step's max blocks × block size
    positions: torch.Tensor  # [num_rows] int64, where each row's new token goes
    refresh: list[tuple[int, torch.Tensor]]  # (row, its block ids [n] int64): gathered again

    def keys_values(self, kv_cache: torch.Tensor, layer: int, k_new: torch.Tensor,
                    v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's decode keys and values, [num_rows, kvh, num_keys, d] each (views), after
        gathering the refreshed rows from `kv_cache` (this layer's [num_blocks, 2, block_size,
        kvh, d], the step's tokens already stored) and writing the step's tokens."""
        k_buf, v_buf = self.mirror.k[layer], self.mirror.v[layer]  # [rows, kvh, keys, d]
        for row, block_ids in self.refresh:
            n = block_ids.numel() * kv_cache.shape[2]
            for buf, kv in ((k_buf, kv_cache[:, 0]), (v_buf, kv_cache[:, 1])):
                blocks = torch.index_select(kv, 0, block_ids)  # [blocks, block_size, kvh, d]
                buf[row, :, :n].copy_(blocks.view(n, *blocks.shape[2:]).transpose(0, 1))
        nd = self.num_rows
        rows = self.mirror.row_index[:nd]
        k_buf[rows, :, self.positions] = k_new[:nd]
        v_buf[rows, :, self.positions] = v_new[:nd]
        return k_buf[:nd, :, : self.num_keys], v_buf[:nd, :, : self.num_keys]


class DecodeKVMirror:
    """Per layer, `[rows, kvh, keys, d]` buffers of keys and values, one row per decode sequence,
    at most `max_bytes` in all (past that a step gathers as before: `plan` returns None). Each
    head's keys are contiguous, the layout CPU SDPA reads fastest (~14% faster than the
    gather's [rows, keys, kvh, d] at 4 × 272 keys; the same values, bit for bit)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, max_bytes: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.max_bytes = max_bytes
        empty = (num_layers, 0, num_kv_heads, 0, head_dim)
        self.k = torch.zeros(empty, dtype=dtype, device=device)
        self.v = torch.zeros(empty, dtype=dtype, device=device)
        self.row_index = torch.empty(0, dtype=torch.long, device=device)
        self._rows: dict[int, _Row] = {}  # row -> what it holds, as of the last completed step
        self._pending: dict[int, _Row] = {}  # the same after the step being run
        self.num_rows_kept = 0  # decode rows served from the mirror, summed over steps
        self.num_rows_gathered = 0  # ... and gathered from the blocks

    def plan(self, decodes: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], DecodeKVStep | None]:
        """Order this step's decode rows by their place in the mirror (the attention's rows
        follow it) and say which rows to gather again. Called every step, with no decodes too:
        a row is reused only from the step just before. None: the mirror is not used."""
        previous, self._rows, self._pending = self._rows, {}, {}
        if not decodes:
            return decodes, None
        bs = self.block_size
        num_rows = len(decodes)
        num_keys = -(-max(d.seq.num_computed_tokens + 1 for d in decodes) // bs) * bs
        if not self._fit(num_rows, num_keys):
            return decodes, None
        if self.k.shape[1] < num_rows or self.k.shape[3] < num_keys:
            previous = {}  # new buffers: every row is gathered
            self._grow(num_rows, num_keys)
        placed: list[ScheduledSeq | None] = [None] * num_rows
        slot_of = {id(r.seq): i for i, r in previous.items()}
        joining: list[ScheduledSeq] = []
        for item in decodes:
            seq = item.seq
            i = slot_of.get(id(seq))
            row = previous.get(i) if i is not None else None
            if (row is not None and i < num_rows and row.seq is seq
                    and row.num_tokens == seq.num_computed_tokens
                    and seq.block_table[: len(row.block_ids)] == row.block_ids):
                placed[i] = item
            else:
                joining.append(item)
        free = [i for i, item in enumerate(placed) if item is None]
        refresh: list[tuple[int, torch.Tensor]] = []
        for i, item in zip(free, joining, strict=True):
            placed[i] = item
            used = -(-(item.seq.num_computed_tokens + 1) // bs)
            refresh.append((i, torch.tensor(item.seq.block_table[:used], dtype=torch.long,
                                            device=self.device)))
        ordered: list[ScheduledSeq] = placed  # type: ignore[assignment]  # every slot filled
        self.num_rows_gathered += len(refresh)
        self.num_rows_kept += num_rows - len(refresh)
        for i, item in enumerate(ordered):
            n = item.seq.num_computed_tokens + 1
            self._pending[i] = _Row(item.seq, n, item.seq.block_table[: -(-n // bs)])
        positions = torch.tensor([item.seq.num_computed_tokens for item in ordered],
                                 dtype=torch.long, device=self.device)
        return ordered, DecodeKVStep(self, num_rows, num_keys, positions, refresh)

    def commit(self) -> None:
        """The step ran: its rows may be reused by the next."""
        self._rows, self._pending = self._pending, {}

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def _bytes_for(self, num_rows: int, num_keys: int) -> int:
        per_token = self.num_kv_heads * self.head_dim * self.k.element_size()
        return 2 * self.num_layers * num_rows * num_keys * per_token

    def _fit(self, num_rows: int, num_keys: int) -> bool:
        return self._bytes_for(num_rows, num_keys) <= self.max_bytes

    def _grow(self, num_rows: int, num_keys: int) -> None:
        """New, larger buffers (the rows are gathered again): rows to the next power of two and
        keys doubled, so a batch that grows one row or one block at a time reallocates a few
        times, not at every step; as much as the budget allows where that does not fit."""
        rows = max(num_rows, self.k.shape[1])
        keys = max(MIN_KEYS, self.k.shape[3])
        while keys < num_keys:
            keys *= 2
        per_key_row = self._bytes_for(1, 1)
        most_keys = self.max_bytes // (per_key_row * rows) // self.block_size * self.block_size
        for r, k in ((max(rows, 1 << (num_rows - 1).bit_length()), keys), (rows, keys),
                     (rows, most_keys), (num_rows, num_keys)):
            if k >= num_keys and self._fit(r, k):
                break
        shape = (self.num_layers, r, self.num_kv_heads, k, self.head_dim)
        del self.k, self.v  # the old buffers go before the new are allocated
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.row_index = torch.arange(r, dtype=torch.long, device=self.device)
