"""The simulation's two explicit coarsenings, for fleets too large to simulate exactly on one
machine (`python -m sim sweep --block-tokens N --route-candidates K`). Neither is on by default;
bench/sim_tiers.py `--validate` runs a sweep both ways and reports how far the figures move.

- `coarsen`: a simulated KV block of `block_tokens` tokens, not the profile's 16: the cache
  bookkeeping (the router's replica, every worker's tiers) holds `block_tokens / 16` times fewer
  entries, and every capacity and per-block cost is scaled so that token figures are conserved
  (a worker's cache holds as many tokens, a token moves and reloads at the same rate). What moves:
  a prompt's last partial block is not cached, so up to `block_tokens - 1` more tokens a turn are
  recomputed, and a transfer rounds up to a coarse block.
- `CandidateSample`: the router's policy (its real code, O(workers) a request: ~6 ms at 1,024
  workers) chooses among the workers holding a prefix of the prompt plus `k` others of each
  role drawn at random, not among every live worker ("power of k choices"). The prefix index
  is still searched over every worker.
"""

from __future__ import annotations

import random
from dataclasses import replace

from router.worker_info import WorkerInfo
from sim.profile import CostProfile


def coarsen(profile: CostProfile, block_tokens: int) -> CostProfile:
    """`profile` at a block of `block_tokens` tokens (a multiple of its block size): block
    counts divided by the factor, bytes and seconds per block multiplied by it."""
    if block_tokens <= 0 or block_tokens % profile.block_size:
        raise ValueError(f"--block-tokens {block_tokens} is not a multiple of the profile's "
                         f"block size {profile.block_size}")
    f = block_tokens // profile.block_size
    return replace(profile, block_size=block_tokens, block_bytes=profile.block_bytes * f,
                   num_blocks=max(1, round(profile.num_blocks / f)),
                   host_blocks=round(profile.host_blocks / f),
                   disk_blocks=round(profile.disk_blocks / f),
                   offload_s_per_block=profile.offload_s_per_block * f,
                   hash_s_per_block=profile.hash_s_per_block * f)


class CandidateSample:
    """Which live workers the policy sees for one request: those holding a leading match, then
    `k` others of each role drawn at random (seeded), in the fleet's order."""

    def __init__(self, k: int, seed: int = 0) -> None:
        if k < 1:
            raise ValueError(f"--route-candidates must be at least 1, got {k}")
        self.k = k
        self._rng = random.Random(seed)
        self._fleet: tuple = ()  # the live list the pools below are of (its workers' ids)
        self._pools: list[list[str]] = []  # worker ids by role
        self._at: dict[str, int] = {}  # worker id -> its place in the live list

    def __call__(self, live: list[WorkerInfo], matches: dict[str, int]) -> list[WorkerInfo]:
        fleet = tuple(map(id, live))
        if fleet != self._fleet:  # (a fleet that scales: its pools again)
            pools: dict[str, list[str]] = {}
            for w in live:
                pools.setdefault(w.role, []).append(w.worker_id)
            self._fleet, self._pools = fleet, list(pools.values())
            self._at = {w.worker_id: i for i, w in enumerate(live)}
        chosen = {w for w, n in matches.items() if n}
        for pool in self._pools:
            if len(pool) <= self.k + len(chosen):
                chosen.update(pool)
                continue
            drawn = [w for w in self._rng.sample(pool, self.k + len(chosen)) if w not in chosen]
            chosen.update(drawn[:self.k])
        return [live[i] for i in sorted(self._at[w] for w in chosen if w in self._at)]
