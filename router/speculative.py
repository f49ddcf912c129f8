"""Speculative prefix entries: what this router just sent where, for the few hundred milliseconds
before the worker's own report of it arrives.

A vLLM worker reports a prompt's blocks (through its `tandem vllm-bridge`) only after the prefill
step that computed them: 0.15-0.23 s measured on vLLM CPU for short prompts, longer for long ones.
Until then a second request with the same prefix would see no holder and land anywhere. The
router therefore counts its own recent decisions as held for `ttl_s` (llm-d and vllm-router use
2 s); the published index takes over when the report arrives, and a block the worker never kept
stops counting when its entry expires, so a wrong guess costs one miss at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from router.index import leading_count
from router.tiered_match import MatchByMedium


class SpeculativeIndex:
    """Per worker, block hashes routed there in the last `ttl_s` seconds (at most
    `max_blocks_per_worker`, oldest dropped first). Not shared between routers: each covers its
    own decisions; the published index covers everyone's once it catches up."""

    def __init__(self, ttl_s: float = 2.0, max_blocks_per_worker: int = 65_536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_blocks_per_worker = max_blocks_per_worker
        self._clock = clock
        # worker id -> block hash -> expiry, in insertion order: with one TTL that is expiry order.
        self._entries: dict[str, dict[int, float]] = {}

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        if self.ttl_s <= 0 or not block_hashes:
            return
        held = self._entries.setdefault(worker_id, {})
        expiry = self._clock() + self.ttl_s
        for h in block_hashes:
            held.pop(h, None)
            held[h] = expiry
        while len(held) > self.max_blocks_per_worker:
            held.pop(next(iter(held)))

    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        """Leading blocks of `block_hashes` routed to each worker within the TTL (async, as
        every index's `match`, though it never waits)."""
        now = self._clock()
        out = dict.fromkeys(worker_ids, 0)
        for w in worker_ids:
            out[w] = leading_count(block_hashes, self._prune(w, now))
        return out

    async def match_by_medium(self, block_hashes: list[int], worker_ids: list[str]
                              ) -> dict[str, MatchByMedium]:
        """`match` as tiered matches: a block just routed is being computed on the device."""
        return {w: MatchByMedium(n) for w, n in (await self.match(block_hashes,
                                                                  worker_ids)).items()}

    def forget(self, known_ids) -> None:
        """Drop the entries of workers no longer in `known_ids` (called when more workers hold
        entries than are known, so memory stays bounded by the fleet)."""
        if len(self._entries) <= len(known_ids):
            return
        for w in [w for w in self._entries if w not in known_ids]:
            del self._entries[w]

    def _prune(self, worker_id: str, now: float) -> dict[int, float]:
        held = self._entries.get(worker_id)
        if not held:
            return {}
        while held:
            first = next(iter(held))
            if held[first] > now:
                break
            del held[first]
        return held
