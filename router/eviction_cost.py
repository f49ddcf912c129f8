"""What a placement costs the cache it lands in. A prompt placed on a worker takes a KV block for
each of its blocks the worker does not already hold on its device; the worker hands out its
empty blocks first and then evicts cached ones, least recently used first (engine/block_pool.py).
Each evicted block is a prefix-cache entry that a later request may miss: it is charged at the
time recomputing it would take there, times `eviction_weight` (the chance it is hit again). So
a new prompt goes where it evicts least, and a worker that rejoins empty takes new work, while a
follow-up still goes where its prefix is (it needs few new blocks there).

A worker's headroom is what it reports (`free_blocks`, `evictable_blocks` in its load; see
`WorkerInfo.headroom`), less the blocks this router sent it since (`note_placement`), since a
report lags by up to a heartbeat.
"""

from __future__ import annotations

from router.reload_cost import PricedHit
from router.settings import RouterSettings
from router.worker_info import WorkerInfo


def new_blocks(w: WorkerInfo, num_tokens: int, device_hit: int) -> int:
    """KV blocks a prompt of `num_tokens` takes on `w` beyond the `device_hit` leading blocks it
    holds there (blocks reloaded from a lower tier, or pulled, take device blocks too)."""
    return max(-(-num_tokens // w.block_size) - device_hit, 0)


def evicted_blocks(w: WorkerInfo, num_new: int) -> int:
    """Cached blocks `w` evicts to hand out `num_new` blocks: what its empty blocks do not
    cover, up to what it can evict (past that the prompt waits for running requests' blocks)."""
    empty, evictable = w.headroom()
    return min(evictable, max(num_new - empty, 0))


def eviction_s(w: WorkerInfo, num_tokens: int, hit: PricedHit, rate: float,
               s: RouterSettings) -> float:
    """The weighted seconds of recompute the blocks a placement on `w` evicts stand for, at
    `rate` (its prefill tokens/s)."""
    if not s.eviction_weight:
        return 0.0
    num_new = new_blocks(w, num_tokens, hit.counted.device)
    return s.eviction_weight * evicted_blocks(w, num_new) * w.block_size / rate


def note_placement(plan, num_tokens: int, matches: dict[str, int], memory_s: float) -> None:
    """The plan's workers take the prompt's blocks they do not hold (`matches`: each one's
    leading match in any tier): remembered until their reports include them."""
    for w in {id(w): w for w in (plan.prefill, plan.decode) if w is not None}.values():
        w.note_placed(new_blocks(w, num_tokens, matches.get(w.worker_id, 0)), memory_s)
