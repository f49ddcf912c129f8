"""Overlapped decode steps (async scheduling, as vLLM v1 does it): step N+1 is queued on the
device before the host reads step N's tokens, so the host's per-step work (stop checks, output
building, scheduling, input building) runs while the GPU computes instead of between graphs.

Step N's sampled ids stay on the device and become step N+1's input ids by a device-to-device
copy. The positions, slots and block tables of N+1 are known ahead: every sequence in flight
advances by one token, and a block is allocated when it crosses a block boundary. A sequence
that stops at step N (EOS, stop token or string, abort) was already queued for N+1: that extra
token is dropped and its blocks were freed as in the synchronous loop (later work on the same
stream runs after the step that still writes them). A length stop is known ahead, so such a
sequence is left out of N+1.

Only steady decode overlaps: every running sequence decodes, nothing waits, and no row needs
its previous token on the host when it is sampled (penalties, structured outputs, min_tokens).
Greedy, seeded and unseeded sampled rows all overlap: each request draws from its own stream,
indexed by its output position (engine/sampler.py), so a dropped row shifts no other row's draw
and the tokens equal the synchronous loop's. Anything else ends the overlap: the step in flight
is finished and returned, and the next `step()` runs the synchronous loop, which may start an
overlap again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.input_buffers import upload
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.output import RequestOutput
from engine.sampler import SampledBatch, Sampler
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import Logprob, Sequence

# The engine's output step for one sampled token: append it, check the stops, finish the
# sequence if one hit (out of the scheduler, blocks freed or held); its output.
AppendToken = Callable[[Sequence, int, Logprob | None], RequestOutput]


@dataclass
class InFlightStep:
    seqs: list[Sequence]  # the step's rows, in order
    sampled: SampledBatch  # their tokens, on the device and on their way to the host


class DecodePipeline:
    """Holds at most one decode step whose tokens the host has not read yet. It runs the
    engine's scheduler, KV manager, model runner and sampler, and hands each token it reads to
    `append_token`, as the synchronous loop does."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, runner: ModelRunner,
                 sampler: Sampler, append_token: AppendToken, max_model_len: int) -> None:
        self.scheduler, self.kv, self.runner, self.sampler = scheduler, kv, runner, sampler
        self.append_token, self.max_model_len = append_token, max_model_len
        self.in_flight: InFlightStep | None = None
        self.enabled = True  # False: the step in flight is finished, no new overlap starts
        self.num_overlapped_steps = 0  # steps queued before the previous one was read
        self.num_drains = 0  # overlaps ended by a batch that must run synchronously

    def wait(self) -> None:
        """Until the step in flight has run on the device. Blocks that a stop freed meanwhile
        are still written by it: whoever fills blocks off the stream (a KV transfer) waits."""
        if self.in_flight is not None:
            self.in_flight.sampled.wait()

    def qualifies(self, out: SchedulerOutput) -> bool:
        """Whether a step the scheduler just made may start an overlap."""
        s = self.scheduler
        return (self.enabled and not out.preempted and not s.waiting
                and len(out.scheduled) == len(s.running)
                and all(item.num_new_tokens == 1 and item.samples and self._overlappable(item.seq)
                        for item in out.scheduled))

    def start(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Queue a qualifying step with its input ids from the host, then go on as `step`."""
        logits, rows = self.runner.execute(out.scheduled)
        self.scheduler.advance(out)
        seqs = [r.seq for r in rows]
        self.in_flight = InFlightStep(seqs, self.sampler.launch(logits, seqs))
        return self.step()

    def step(self) -> list[RequestOutput]:
        """Queue the next step (when it qualifies), then read and return the one before."""
        prev = self.in_flight
        assert prev is not None
        continuing = [s for s in prev.seqs if not s.is_finished]
        alive = self._next_batch(continuing)
        self.in_flight = None
        if alive:
            keep = {id(s) for s in alive}
            index = [i for i, s in enumerate(prev.seqs) if id(s) in keep]
            ids = prev.sampled.token_ids  # [len(prev.seqs)]
            if index != list(range(len(alive))):
                (rows,) = upload([np.asarray(index, dtype=np.int64)], ids.device)
                ids = ids.index_select(0, rows)
            else:
                ids = ids[: len(alive)]
            logits, rows = self.runner.execute([ScheduledSeq(s, 1, True) for s in alive], ids)
            for s in alive:
                s.num_computed_tokens += 1
            # The logits' rows in the runner's order (the SDPA path orders decode rows by their
            # place in engine/decode_kv_mirror.py). Each row's token of the step before is not
            # in its output yet: one pending.
            seqs = [r.seq for r in rows]
            self.in_flight = InFlightStep(seqs, self.sampler.launch(logits, seqs, 1))
            self.num_overlapped_steps += 1
        else:
            self.num_drains += bool(continuing)
            keep = set()
        return self._read(prev, keep)

    def _next_batch(self, continuing: list[Sequence]) -> list[Sequence]:
        """The sequences of the next overlapped step; [] when it must not overlap (the
        synchronous loop schedules it once the step in flight is read)."""
        s = self.scheduler
        if (not self.enabled or s.waiting or s.loading or len(s.running) != len(continuing)
                # the same sequences, in any order (the runner may order rows its own way)
                or {id(seq) for seq in s.running} != {id(seq) for seq in continuing}
                or len(continuing) > s.max_num_batched_tokens):
            return []
        alive = [seq for seq in continuing if not self._stops_for_length(seq)]
        bs = self.kv.block_size
        for seq in alive:
            # Its in-flight token is counted in num_computed_tokens already: room for the next,
            # a new block when the next position starts one.
            if (seq.num_computed_tokens >= len(seq.block_table) * bs
                    and not self.kv.allocate(seq, 1)):
                return []  # short of blocks: the scheduler preempts, synchronously
        return alive

    def _read(self, step: InFlightStep, flying: set[int]) -> list[RequestOutput]:
        """Append `step`'s tokens (waiting for its copy alone) and check stops."""
        token_ids, logprobs = step.sampled.resolve()
        outputs: list[RequestOutput] = []
        for seq, token_id, lp in zip(step.seqs, token_ids, logprobs, strict=True):
            if seq.is_finished:
                continue  # stopped at the step before, or aborted: the extra token is dropped
            # Blocks whose tokens are all computed by now (not by the step still in flight).
            self.kv.cache_computed_blocks(seq, seq.num_computed_tokens - (id(seq) in flying))
            outputs.append(self.append_token(seq, token_id, lp))
        return outputs

    def _stops_for_length(self, seq: Sequence) -> bool:
        """Whether the token in flight certainly ends `seq` by a length limit."""
        p = seq.params
        return (len(seq.output_token_ids) + 1 >= p.max_tokens
                or seq.num_tokens + 1 >= self.max_model_len)

    @staticmethod
    def _overlappable(seq: Sequence) -> bool:
        p = seq.params
        return (not p.needs_penalties and p.structured is None and seq.matcher is None
                and not seq.hold_blocks and len(seq.output_token_ids) >= p.min_tokens)
