"""A drain's hand-off, the router's part (docs/contract.md "Drain hand-off"; the worker's part is
worker/handoff.py). A stream whose last event names `handoff_block_hashes` was ended on purpose
by its draining worker: it resumes on another worker with every token the client has, as a
failed stream does but without counting a failure against the worker, and the draining worker
is asked to lease those blocks to the new one, which pulls them instead of recomputing prompt
and tokens so far. No lease (the worker gone already, or holding none): the new worker
recomputes them, as without hand-offs."""

from __future__ import annotations

import aiohttp

from common.protocol import StreamEvent
from router.peer_pull import lease_prefix
from router.worker_info import WorkerInfo


class HandedOff(Exception):
    """`worker` handed the stream off, holding the blocks of `block_hashes` for the next."""

    def __init__(self, worker: WorkerInfo, block_hashes: list[int]) -> None:
        super().__init__(f"{worker.worker_id} handed the stream off (draining)")
        self.worker, self.block_hashes = worker, block_hashes


def check_handoff(w: WorkerInfo, ev: StreamEvent) -> None:
    """Raise `HandedOff` for a hand-off event."""
    if ev.handoff_block_hashes is not None and ev.finish_reason is None:
        raise HandedOff(w, ev.handoff_block_hashes)


async def take_over(backends: dict, h: HandedOff, new: WorkerInfo, request_id: str,
                    timeout: aiohttp.ClientTimeout) -> dict:
    """The keyword the resume leg on `new` takes: the draining worker's lease of the blocks it
    handed off ({} when it gives none)."""
    prefix = await lease_prefix(backends, h.worker, new, f"{request_id}.handoff",
                                h.block_hashes, timeout)
    return {"prefix_kv": prefix} if prefix is not None else {}
