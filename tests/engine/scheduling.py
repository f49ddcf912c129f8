"""Driving a Scheduler by hand, without a model: the step plans of test_scheduler.py and
test_parking.py."""

from __future__ import annotations

from common.hashing import BlockHasher
from engine import SamplingParams
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence

BLOCK = 4


def make_scheduler(num_blocks: int = 4096, max_num_seqs: int = 16, budget: int = 2048,
                   threshold: int | None = None) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), BLOCK, BlockHasher("m", BLOCK))
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     long_prefill_token_threshold=threshold)


def add(s: Scheduler, rid: str, num_tokens: int, max_tokens: int = 8) -> Sequence:
    seq = Sequence(rid, [(7 * i + len(rid)) % 200 for i in range(num_tokens)],
                   SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    return seq


def plan(s: Scheduler) -> dict[str, int]:
    """One step: what each scheduled sequence computes, applied as the engine would."""
    out = s.schedule()
    for item in out.scheduled:  # what the engine does after the model step
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.samples:
            item.seq.output_token_ids.append(1)
    return {item.seq.request_id: item.num_new_tokens for item in out.scheduled}
