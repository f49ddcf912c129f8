"""Continuous batching with chunked prefill (in the style of vLLM v1's scheduler).

Every step has a token budget. Running sequences are served first, in admission order (one token
for a decode, the next chunk for a prefill in progress); then waiting sequences are admitted
while budget, sequence slots and blocks last. When a running sequence cannot get a block, the
most recently admitted running sequence is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed (its full blocks usually come straight back from the
prefix cache).

Long prompts are prefilled one after another, not side by side (vLLM's
`max_long_partial_prefills`): a step holds at most `max_long_prefills` prefills of more than
`long_prefill_token_threshold` tokens, and a long prompt waits while short ones behind it are
admitted. Equal work split across two prompts gives both their first token when both are done;
done in turn, the first one is answered in half the time and the second no later, and the
running decodes get a step between the two (shorter steps, lower inter-token latency).

A request whose reader has fallen behind is parked (`park`): it leaves the queues and costs no
compute, keeping its blocks until blocks run short, when the longest-parked one's are freed
before any running sequence is preempted (it is recomputed, mostly from the prefix cache, once
resumed). `unpark` puts it at the front of the queue. The engine's client decides both from the
tokens its reader has not taken yet (engine/output_stream.py).

A sequence whose prefix continues in the KV tiers (host memory, disk) is loading from admission
until its blocks are filled (engine/kv_cache_manager.py `start_load`): it holds those blocks, is
not scheduled, and counts as waiting for the overlapped decode loop; the running sequences' steps
go on meanwhile. Once its load is done it goes back to the front of the queue, and its admission
finds the blocks that loaded as prefix-cache hits (the rest, if a file was gone or corrupt, is
computed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.fair_share import FairShare
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus

# With nothing to schedule but loads in flight, a step waits this long for one to finish (the
# engine's loop reads its messages between two steps).
LOAD_WAIT_S = 0.005


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
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int | None = None,
                 max_long_prefills: int = 1) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # None: no limit
        self.max_long_prefills = max_long_prefills
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # in the order they were parked
        self.loading: list[Sequence] = []  # blocks being filled from the KV tiers
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_computed(self, seq: Sequence) -> None:
        """A sequence whose KV is in place (imported) joins the batch, or, when the batch is
        full, waits with its blocks: admission then computes only its last token."""
        if len(self.running) < self.max_num_seqs:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            self.add(seq)

    def has_work(self) -> bool:
        """Whether a step would compute anything or finish a load (parked sequences wait for
        their reader)."""
        return bool(self.waiting or self.running or self.loading or self.kv.num_loads)

    def stats(self) -> dict[str, int]:
        """Queue lengths, and the tokens the waiting sequences have yet to compute (a copy of the
        queue is summed: another thread may read this while the engine's thread steps)."""
        return {"running": len(self.running), "waiting": len(self.waiting),
                "parked": len(self.parked), "loading": len(self.loading),
                "preemptions": self.num_preemptions,
                "waiting_tokens": sum(s.num_tokens - s.num_computed_tokens
                                      for s in list(self.waiting))}

    def park(self, seq: Sequence) -> bool:
        """Take a waiting or running `seq` out of scheduling, keeping its blocks; False if it is
        in neither queue (finished, importing or parked already)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        seq.status = SequenceStatus.PARKED
        self.parked.append(seq)
        return True

    def unpark(self, seq: Sequence) -> bool:
        """Back to the front of the queue (with its blocks, if it still has them: admission then
        computes only its last token); False if it is not parked."""
        if seq not in self.parked:
            return False
        self.parked.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        return True

    def release_parked(self) -> bool:
        """Free the blocks of the longest-parked sequence that holds any; False if none does."""
        for seq in self.parked:
            if seq.block_table:
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                seq.tier_loaded = False
                seq.num_preemptions += 1
                self.num_preemptions += 1
                return True
        return False

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] = ()) -> bool:
        """`KVCacheManager.allocate`, taking parked sequences' blocks when blocks are short."""
        while not self.kv.allocate(seq, num_new_tokens, prefix_blocks):
            if not self.release_parked():
                return False
        return True

    def allocate_fairly(self, seq: Sequence, num_new_tokens: int,
                        prefix_blocks: list[int] = ()) -> bool:
        """`allocate` for a sequence outside the batch (an import, between steps): when blocks
        are short, running sequences of a client that runs at least two more than `seq`'s give
        theirs (engine/fair_share.py), as they would to a waiting sequence."""
        fair, out = FairShare(self.running), SchedulerOutput()  # no step is being planned
        while not self.allocate(seq, num_new_tokens, prefix_blocks):
            if self._give_way(seq, fair, out) is None:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = list(self.running)
        fair = FairShare(running)
        num_long = 0
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            num_long += self._is_long(seq.num_tokens - seq.num_computed_tokens)
            while not self.allocate(seq, num_new):
                victim = fair.victim(running[i:])
                running.remove(victim)
                fair.remove(victim)
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
        if out.preempted:
            return out
        self._reap_loads()
        deferred: list[Sequence] = []  # long prompts waiting for the one in progress
        while self.waiting and budget > 0:
            seq = self.waiting[fair.next_waiting(self.waiting)]
            if len(self.running) >= self.max_num_seqs:
                freed = self._give_way(seq, fair, out)
                if freed is None:
                    break
                budget += freed
            if not seq.block_table and self.kv.start_load(seq):
                self.waiting.remove(seq)
                seq.status = SequenceStatus.LOADING
                self.loading.append(seq)
                continue
            prefix = self.kv.computed_prefix(seq, reload=False) if not seq.block_table else []
            computed = len(prefix) * self.kv.block_size if prefix else seq.num_computed_tokens
            long = self._is_long(seq.num_tokens - computed)
            if long and num_long >= self.max_long_prefills:
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            while not self.allocate(seq, min(seq.num_tokens - computed, budget), prefix):
                freed = self._give_way(seq, fair, out)
                if freed is None:
                    break
                budget += freed
            else:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                fair.add(seq)
                num_new = min(seq.num_tokens - computed, budget)
                out.scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
                num_long += long
                continue
            break
        self.waiting.extendleft(reversed(deferred))  # back in front, in their order
        if not out.scheduled and self.kv.num_loads:
            self.kv.wait_loads(LOAD_WAIT_S)  # the next step takes what finished
        return out

    def _reap_loads(self) -> None:
        """Loaded sequences back to the front of the queue, in the order they started."""
        done = [s for s in self.kv.finished_loads() if s in self.loading]
        for seq in done:
            self.loading.remove(seq)
            seq.status = SequenceStatus.WAITING
        self.waiting.extendleft(reversed(done))

    def advance(self, out: SchedulerOutput) -> None:
        """`out` ran on the model: each sequence's computed tokens move on, and the blocks it
        filled are offered to the prefix cache."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(item.seq)

    def _give_way(self, seq: Sequence, fair: FairShare, out: SchedulerOutput) -> int | None:
        """Preempt the running sequence that gives its place and blocks to `seq`
        (engine/fair_share.py), taking it out of this step's plan; returns the tokens that
        frees of the step's budget, or None if no client runs enough more than `seq`'s."""
        donor = fair.donor(self.running, seq)
        if donor is None:
            return None
        self.running.remove(donor)
        fair.remove(donor)
        freed = sum(x.num_new_tokens for x in out.scheduled if x.seq is donor)
        out.scheduled = [x for x in out.scheduled if x.seq is not donor]
        self._preempt(donor)
        out.preempted.append(donor)
        return freed

    def _is_long(self, num_prefill_tokens: int) -> bool:
        t = self.long_prefill_token_threshold
        return t is not None and num_prefill_tokens > t

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.tier_loaded = False
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
        elif seq in self.parked:
            self.parked.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
