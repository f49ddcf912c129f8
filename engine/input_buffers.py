"""A step's model inputs as host arrays, and how they reach the device without a host sync.

`build_step_inputs` lays the flat batch out (decode rows first, one token each, then the prefill
chunks) as numpy arrays. `upload` packs arrays of one dtype into one pinned buffer and copies it
with `non_blocking=True` (the eager GPU path). `InputBuffers` are the static device buffers that
CUDA graphs read (engine/cuda_graph.py), refilled each decode step from pinned staging memory in
two copies; rows past the step's (a bucket's padding) write no KV and have context length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.scheduler import ScheduledSeq


@dataclass
class PrefillRows:
    query_start: int  # index of the chunk's first token in the flat batch
    num_query_tokens: int
    context_len: int  # tokens of this sequence in the cache after this step
    block_table: np.ndarray  # [num_blocks_of_seq] int64


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, block * block_size + offset
    context_lens: np.ndarray  # [num_decodes] int32
    block_tables: np.ndarray  # [num_decodes, max_blocks] int32, 0-padded
    sample_index: np.ndarray  # [num_samples] int64, rows whose logits are sampled
    sample_rows: list[ScheduledSeq]
    prefills: list[PrefillRows]

    @property
    def num_decodes(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def samples_every_row(self) -> bool:
        return len(self.sample_index) == self.num_tokens


def build_step_inputs(batch: list[ScheduledSeq], block_size: int,
                      pending_ids: bool = False) -> StepInputs:
    """The host arrays of one step. Single-token work (decodes, one-token prefill tails) comes
    first, as the SDPA path orders it too. `pending_ids`: the decode rows' input ids are still
    on the device (an overlapped step, engine/decode_pipeline.py): 0 here, the caller copies
    them in."""
    decodes = [s for s in batch if s.num_new_tokens == 1]
    prefills = [s for s in batch if s.num_new_tokens > 1]
    ids, positions, slots, lens, tables = [], [], [], [], []
    sample_index: list[int] = []
    sample_rows: list[ScheduledSeq] = []
    for i, item in enumerate(decodes):
        seq = item.seq
        pos = seq.num_computed_tokens
        table = seq.block_table
        ids.append(0 if pending_ids else seq.token_at(pos))
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        lens.append(pos + 1)
        tables.append(table)
        if item.samples:
            sample_index.append(i)
            sample_rows.append(item)
    num_blocks = -(-max(lens) // block_size) if lens else 0
    block_tables = np.zeros((len(decodes), num_blocks), dtype=np.int32)
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        used = -(-n // block_size)
        block_tables[i, :used] = table[:used]
    id_parts = [np.asarray(ids, dtype=np.int64)]
    pos_parts = [np.asarray(positions, dtype=np.int64)]
    slot_parts = [np.asarray(slots, dtype=np.int64)]
    chunks: list[PrefillRows] = []
    start = len(decodes)
    for item in prefills:
        seq, n = item.seq, item.num_new_tokens
        first = seq.num_computed_tokens
        ctx = first + n
        table = np.asarray(seq.block_table[: -(-ctx // block_size)], dtype=np.int64)
        pos = np.arange(first, ctx, dtype=np.int64)
        id_parts.append(np.asarray(seq.all_token_ids[first:ctx], dtype=np.int64))
        pos_parts.append(pos)
        slot_parts.append(table[pos // block_size] * block_size + pos % block_size)
        chunks.append(PrefillRows(start, n, ctx, table))
        start += n
        if item.samples:
            sample_index.append(start - 1)
            sample_rows.append(item)
    return StepInputs(
        input_ids=np.concatenate(id_parts), positions=np.concatenate(pos_parts),
        slot_mapping=np.concatenate(slot_parts), context_lens=np.asarray(lens, dtype=np.int32),
        block_tables=block_tables, sample_index=np.asarray(sample_index, dtype=np.int64),
        sample_rows=sample_rows, prefills=chunks,
    )


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays on `device`, one pinned buffer and one non-blocking copy per dtype. The
    caching host allocator keeps a pinned block until its copy has run, so no sync is needed."""
    out: list[torch.Tensor | None] = [None] * len(arrays)
    pin = device.type == "cuda"
    for dtype in dict.fromkeys(a.dtype for a in arrays):
        members = [i for i, a in enumerate(arrays) if a.dtype == dtype]
        # Each array starts 16-byte aligned, as Triton specialises kernels on pointer alignment
        # (an unaligned table would compile a second variant of a kernel mid-run).
        step = 16 // dtype.itemsize
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += -(-arrays[i].size // step) * step
        host = torch.empty(max(total, 1), dtype=_TORCH[dtype], pin_memory=pin)
        flat = host.numpy()
        for i, offset in zip(members, offsets, strict=True):
            flat[offset : offset + arrays[i].size] = arrays[i].reshape(-1)
        dev = host.to(device, non_blocking=True) if pin else host
        for i, offset in zip(members, offsets, strict=True):
            out[i] = dev[offset : offset + arrays[i].size].view(arrays[i].shape)
    return out  # type: ignore[return-value]


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class InputBuffers:
    """Static device inputs of decode steps, `max_num_seqs` rows: the addresses CUDA graphs are
    captured with. Each step writes pinned staging memory and copies it in two transfers."""

    def __init__(self, max_num_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        rows = max_num_seqs
        pin = device.type == "cuda"
        # int64: input_ids, positions, slot_mapping; int32: context_lens, then block tables.
        self._host64 = torch.zeros(3 * rows, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(rows * (1 + max_blocks), dtype=torch.int32, pin_memory=pin)
        self._dev64 = torch.zeros(3 * rows, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(rows * (1 + max_blocks), dtype=torch.int32, device=device)
        self.input_ids = self._dev64[:rows]  # [max_num_seqs]
        self.positions = self._dev64[rows : 2 * rows]  # [max_num_seqs]
        self.slot_mapping = self._dev64[2 * rows :]  # [max_num_seqs]
        self.context_lens = self._dev32[:rows]  # [max_num_seqs]
        self.block_tables = self._dev32[rows:].view(rows, max_blocks)  # [max_num_seqs, max_blocks]
        self._h64 = self._host64.numpy().reshape(3, rows)
        self._h_lens = self._host32.numpy()[:rows]
        self._h_tables = self._host32.numpy()[rows:].reshape(rows, max_blocks)
        # Recorded after each step's copies: the staging memory is rewritten only once they ran.
        self._copied = torch.cuda.Event() if pin else None
        self.clear()

    def clear(self) -> None:
        """Every row padding (slot -1, context 0): what graphs are captured with."""
        self._h64[:] = 0
        self._h64[2] = -1
        self._h_lens[:] = 0
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)

    def load(self, step: StepInputs, num_rows: int) -> None:
        """Copy a decode-only step into the first `num_rows` rows; rows past the step's are
        padding: token 0 at position 0, no KV slot (-1), context length 0."""
        n = step.num_decodes
        if step.prefills or not n <= num_rows <= self.max_num_seqs:
            raise ValueError(f"a decode-only step of at most {num_rows} rows is needed")
        width = step.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds {self.max_blocks}")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have run (normally long ago)
        h = self._h64
        h[0, :n], h[1, :n], h[2, :n] = step.input_ids, step.positions, step.slot_mapping
        h[0:2, n:num_rows] = 0
        h[2, n:num_rows] = -1
        self._h_lens[:n] = step.context_lens
        self._h_lens[n:num_rows] = 0
        self._h_tables[:n, :width] = step.block_tables
        non_blocking = self._copied is not None
        self._dev64.copy_(self._host64, non_blocking=non_blocking)
        used = self.max_num_seqs + num_rows * self.max_blocks  # lengths + the rows' tables
        self._dev32[:used].copy_(self._host32[:used], non_blocking=non_blocking)
        if self._copied is not None:
            self._copied.record()
