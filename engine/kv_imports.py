"""Requests whose KV comes from elsewhere (a prefill worker's blocks, a resumed stream's): their
blocks are allocated first and filled by a KV transfer; then each joins the batch with all but
its last known token computed, or, when the transfer failed, prefills locally after the prefix
it found in this worker's cache."""

from __future__ import annotations

from collections.abc import Callable

from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


class KVImports:
    """The sequences waiting for a transfer to fill their blocks, by request id."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager,
                 wait_for_device: Callable[[], None]) -> None:
        """`wait_for_device`: returns once no step queued on the device still writes blocks
        (engine/decode_pipeline.py `wait`): a transfer must not race those writes."""
        self.scheduler, self.kv, self.wait_for_device = scheduler, kv, wait_for_device
        self.waiting: dict[str, Sequence] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    def __len__(self) -> int:
        return len(self.waiting)

    def start(self, seq: Sequence) -> int:
        """Allocate `seq`'s blocks for every token but its last (which the next step computes);
        how many leading blocks are here already (prefix cache hits). `MemoryError` when blocks
        are short, nothing allocated."""
        self.wait_for_device()
        prefix = self.kv.computed_prefix(seq)
        num_needed = seq.num_tokens - 1 - len(prefix) * self.kv.block_size
        if not self.scheduler.allocate_fairly(seq, num_needed, prefix):
            raise MemoryError("not enough free KV blocks to import the request")
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.waiting[seq.request_id] = seq
        return len(prefix)

    def finish(self, request_id: str, success: bool) -> bool:
        """The transfer filled the blocks (join the batch) or failed (prefill locally instead).
        False if the request is no longer waiting (it was aborted meanwhile)."""
        seq = self.waiting.pop(request_id, None)
        if seq is None:
            return False
        if success:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.kv.cache_computed_blocks(seq)
            self.scheduler.add_computed(seq)
        else:
            # Keep the locally cached prefix; recompute everything after it.
            keep = seq.num_cached_tokens // self.kv.block_size
            self.kv.free_after(seq, keep)
            seq.num_computed_tokens = keep * self.kv.block_size
            self.scheduler.add(seq)
        return True

    def drop(self, request_id: str) -> None:
        """Forget `request_id` (aborted: its blocks go with the sequence)."""
        self.waiting.pop(request_id, None)
