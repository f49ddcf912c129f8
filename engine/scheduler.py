"""Continuous batching with chunked prefill (in the style of vLLM v1's scheduler).

Every step has a token budget. Running sequences are served first, in admission order (one token
for a decode, the next chunk for a prefill in progress); then waiting sequences are admitted
while budget, sequence slots and blocks last. When a running sequence cannot get a block, the
most recently admitted running sequence is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed (its full blocks usually come straight back from the
prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    samples: bool  # this step reaches the end of the known tokens, so a token is sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = list(self.running)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, num_new):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
                i += 1
        self.running = running

        # Admitting new work while others were just preempted would only thrash.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.kv.computed_prefix(seq) if not seq.block_table else []
            computed = len(prefix) * self.kv.block_size if prefix else seq.num_computed_tokens
            num_new = min(seq.num_tokens - computed, budget)
            if not self.kv.allocate(seq, num_new, prefix):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return out

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues (finished or aborted); the caller frees or keeps blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
