"""One vLLM KV-event publisher's batches, in order, each once, or a reset where that cannot be.

vLLM numbers its batches (`seq`) from 0 in each process: the numbers start over when vLLM
restarts, and nothing on the wire names the process. Its replay socket keeps the last
`buffer_steps` (10,000) batches; "nothing newer" and "trimmed" look alike but for the first seq
returned. The sockets and the wire are vllm_bridge/link.py's.

`EventSubscriber.items()` yields `Batch(seq, payload)` or `Reset(reason)`. A reset means: what
was built from the batches before it is void; the batches after it start over (from seq 0 after
"restarted", from wherever history still reaches after "history_lost"). How it gets there:

- start: replay from 0 while the link queues live batches (in bytes, `max_queued_bytes`; one
  that does not fit is dropped and counted, a gap replayed next), then take live batches in
  order. A replay that begins above the seq asked for means history is lost:
  reset("history_lost"), continue from what is there (Dynamo's bootstrap does the same).
- live: seq == next: deliver. seq > next (a gap): replay. seq < next: a batch delivered before
  comes again (dropped: a replay already gave it) or another process's batch under a seq seen
  before: vLLM restarted, reset("restarted"), catch up from 0 by replay.
- A replay after a gap, and one after the SUB reconnects (a socket monitor sees it), starts at
  the last seq delivered and checks that batch is byte-identical to the one delivered (payloads
  carry a timestamp): a fresh process's buffer is empty there or holds another batch, so a
  restart is seen even when the new seqs have already passed the old ones.
- A replay that cannot fill the gap (trimmed, or no answer within `replay_timeout_s`, after which
  the DEALER is made anew) resets with "history_lost" and goes on from the live batch.
- Without a replay endpoint (degraded, not recommended): a gap resets with "history_lost", a seq
  going back with "restarted", a reconnect with "reconnected"; lost blocks stay lost until vLLM
  restarts or a request reports its whole prefix (`kv_cache_report_mode: full`).

Malformed messages are counted and skipped, and batches that do not fit the link's byte budget
are dropped and counted (link.py). Consecutive resets are merged into one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import xxhash

from vllm_bridge.events import MAX_PAYLOAD_BYTES
from vllm_bridge.link import PublisherLink, ReplayTimeout

log = logging.getLogger(__name__)

ResetReason = Literal["history_lost", "restarted", "reconnected"]
RESET_REASONS: tuple[ResetReason, ...] = ("history_lost", "restarted", "reconnected")
COUNT_KEYS = ("batches", "duplicates", "gaps", "replays", "replay_timeouts", "malformed",
              "dropped", "reconnects", *(f"reset_{r}" for r in RESET_REASONS))


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    payload: memoryview  # bytes-like: where ZMQ received it (vllm_bridge/link.py)


@dataclass(frozen=True, slots=True)
class Reset:
    reason: ResetReason


Item = Batch | Reset


class EventSubscriber:
    """Subscribes to one publisher (one vLLM data-parallel rank). Not reusable: `items()` once."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *,
                 replay_timeout_s: float = 5.0, max_payload_bytes: int = MAX_PAYLOAD_BYTES,
                 max_queued_bytes: int = 2 * MAX_PAYLOAD_BYTES, max_replayed: int = 1 << 20,
                 window: int = 4096) -> None:
        self.endpoint = endpoint
        self.replay_timeout_s = replay_timeout_s
        self.window = window  # delivered batches remembered to tell repeats from a restart
        self.counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        self.link = PublisherLink(endpoint, replay_endpoint, topic.encode(), self.counts,
                                  replay_timeout_s=replay_timeout_s,
                                  max_payload_bytes=max_payload_bytes,
                                  max_queued_bytes=max_queued_bytes, max_replayed=max_replayed)
        self.has_replay = bool(replay_endpoint)
        self.next_seq: int | None = 0 if self.has_replay else None  # None: take the first one
        self._digests: dict[int, int] = {}  # seq -> xxh3 of its payload, the last `window`

    # ---- the stream ---------------------------------------------------------------------------

    async def items(self) -> AsyncIterator[Item]:
        """Batches and resets, forever (until the caller stops iterating or cancels)."""
        self.link.open()
        last_reset = False
        try:
            async for item in self._stream():
                if isinstance(item, Reset):
                    if last_reset:
                        continue  # one reset says it all
                    self.counts[f"reset_{item.reason}"] += 1
                    log.info("vLLM events from %s: reset (%s)", self.endpoint, item.reason)
                last_reset = isinstance(item, Reset)
                yield item
        finally:
            self.link.close()

    async def _stream(self) -> AsyncIterator[Item]:
        if self.has_replay:
            async for item in self._catch_up(None):
                yield item
        while True:
            message = await self.link.receive()
            if message is None:  # the SUB socket reconnected
                async for item in self._on_reconnect():
                    yield item
            else:
                async for item in self._on_live(*message):
                    yield item

    async def _on_live(self, seq: int, payload: memoryview) -> AsyncIterator[Item]:
        if self.next_seq is None:  # degraded, first batch: whatever came before it is unknown
            if seq > 0:
                yield Reset("history_lost")
            yield self._deliver(seq, payload)
            return
        if seq == self.next_seq:
            yield self._deliver(seq, payload)
            return
        if seq < self.next_seq and self._digests.get(seq) == _digest(payload):
            self.counts["duplicates"] += 1  # a replay gave it already
            return
        if seq > self.next_seq:
            self.counts["gaps"] += 1
        if not self.has_replay:
            reason: ResetReason = "history_lost" if seq > self.next_seq else "restarted"
            self._forget(seq)
            yield Reset(reason)
            yield self._deliver(seq, payload)
            return
        if seq < self.next_seq:  # another batch under a seq seen before: a new process
            self._forget(0)
            yield Reset("restarted")
        async for item in self._catch_up((seq, payload)):
            yield item

    async def _on_reconnect(self) -> AsyncIterator[Item]:
        self.counts["reconnects"] += 1
        if not self.has_replay:
            if self.next_seq is not None:  # it may be another process now: nothing can tell
                self._forget(None)
                yield Reset("reconnected")
            return
        async for item in self._catch_up(None):
            yield item

    async def _catch_up(self, live: tuple[int, memoryview] | None) -> AsyncIterator[Item]:
        """Replay from the last batch delivered (checking it is still the one delivered) or
        from 0, then take `live`, the batch that showed a gap, if any."""
        for _ in range(3):  # a restart found mid-replay starts it over from 0
            assert self.next_seq is not None
            verify = self.next_seq > 0
            start = self.next_seq - 1 if verify else 0
            first: int | None = None
            restarted = False
            self.counts["replays"] += 1
            try:
                async for seq, payload in self.link.replay(start):
                    if first is None:
                        first = seq
                        if seq != start:  # trimmed: what came before `seq` is gone
                            self._forget(seq)
                            yield Reset("history_lost")
                    if seq < self.next_seq:
                        digest = _digest(payload)
                        if self._digests.get(seq, digest) != digest:
                            restarted = True
                            break
                        continue
                    if seq > self.next_seq:  # a hole inside the answer (a malformed batch)
                        self._forget(seq)
                        yield Reset("history_lost")
                    yield self._deliver(seq, payload)
            except ReplayTimeout:
                self.counts["replay_timeouts"] += 1
                log.warning("vLLM events: no replay answer from %s within %.1f s",
                            self.link.replay_endpoint, self.replay_timeout_s)
                self.link.new_dealer()
                break
            if restarted:
                self.link.new_dealer()  # the rest of that answer is not read
                self._forget(0)
                yield Reset("restarted")
                continue
            if first is None and verify:  # nothing at the last seq delivered: a new process
                self._forget(0)
                yield Reset("restarted")
                continue  # what it sent before the SUB reconnected, from 0
            break
        if live is None:
            return
        seq, payload = live
        assert self.next_seq is not None
        if seq > self.next_seq:  # the replay could not reach it
            self._forget(seq)
            yield Reset("history_lost")
        if seq == self.next_seq:
            yield self._deliver(seq, payload)
        # below: the replay delivered it

    def _deliver(self, seq: int, payload: memoryview) -> Batch:
        self.next_seq = seq + 1
        self._digests[seq] = _digest(payload)
        if len(self._digests) > self.window:
            del self._digests[next(iter(self._digests))]
        self.counts["batches"] += 1
        return Batch(seq, payload)

    def _forget(self, next_seq: int | None) -> None:
        """After a reset: the stream starts over at `next_seq` (None: at the next batch)."""
        self.next_seq = next_seq
        self._digests.clear()


def _digest(payload: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)
