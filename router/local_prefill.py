"""A leg that prefills on the worker that streams it (decode_local, colocated, a resume) counts
its uncached prompt tokens in that worker's queue (`WorkerInfo.inflight_tokens`) until its first
token arrives, as a prefill leg does (router/dispatch.py). Worker reports lag by up to a
heartbeat: without this, a burst (a fork: many requests extending one cached context) routed
before the next report sees the holder of the prefix idle and piles onto it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from common.protocol import StreamEvent
from router.worker_info import WorkerInfo


def uncached_tokens(plan, w: WorkerInfo, num_tokens: int) -> int:
    """What `w` computes of a `num_tokens` prompt: the plan's cached and pulled blocks are its
    own when it is the plan's computing worker; another (a resume) computes it all."""
    if w is not plan.decode or plan.prefill is not None:
        return num_tokens
    held = max(plan.cached_blocks, plan.pull_blocks if plan.kv_source is not None else 0)
    return max(num_tokens - held * w.block_size, 0)


async def queued_until_first(events: AsyncIterator[StreamEvent], w: WorkerInfo,
                             num_tokens: int) -> AsyncIterator[StreamEvent]:
    """`events`, with `num_tokens` in `w`'s queue until the first of them (or the leg's end)."""
    w.inflight_tokens += num_tokens
    try:
        async for ev in events:
            if num_tokens:
                w.inflight_tokens -= num_tokens
                num_tokens = 0
            yield ev
    finally:
        w.inflight_tokens -= num_tokens
        await events.aclose()
