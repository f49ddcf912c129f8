"""The puller's side of a peer prefix pull (docs/contract.md "Peer prefix pulls"): before a
request is computed here, the leading blocks a peer leased for it (worker/prefix_export.py) are
pulled into this worker's prefix cache, so admission finds them and only the rest is computed.

Any failure (a handle that is not signed for this worker and this prompt, expired, replayed; the
holder gone or refusing mid-pull; blocks short here) pulls nothing: the prompt is computed as if
there had been no handle. Blocks reserved for the pull are freed on every path, and cached only
once the transfer filled them, so no token ever comes from a block nobody wrote."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from common.protocol import KVTransferParams
from kv_transfer import handle
from kv_transfer.layout import BlockRangeError, LayoutMismatch
from kv_transfer.transport import TransferError, TransferTimeout
from worker.state import WorkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pulled:
    """What a peer prefix pull moved: prompt tokens, KV bytes, seconds."""

    num_tokens: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


async def pull_prefix(state: WorkerState, kvp: KVTransferParams | None, request_id: str,
                      prompt: list[int], cache_salt: str | None = None) -> Pulled:
    """Pull the leading blocks `kvp` names into this worker's prefix cache (`Pulled()`: none)."""
    if kvp is None:
        return Pulled()
    s, core, engine, connector = state.settings, state.core, state.engine, state.connector
    metrics = state.metrics
    if connector is None:
        metrics.peer_pull_fallbacks.labels("no_kv_transport").inc()
        return Pulled()
    hashes = core.hasher(prompt, cache_salt=cache_salt)
    try:
        num_blocks = handle.verify_prefix(kvp, s.internal_token, s.resolved_worker_id, hashes,
                                          s.require_signed_handles)
    except handle.InvalidHandle as e:
        metrics.peer_pull_fallbacks.labels("invalid_handle").inc()
        log.warning("refused a prefix handle (%s); computing the prompt",
                    e, extra={"request_id": request_id})
        return Pulled()
    if not state.spent_prefix_handles.spend(kvp):
        metrics.peer_pull_fallbacks.labels("replayed_handle").inc()
        log.warning("refused a prefix handle used before; computing the prompt",
                    extra={"request_id": request_id})
        return Pulled()
    # The last prompt token is always computed (its logits give the first token).
    num_blocks = min(num_blocks, (len(prompt) - 1) // core.block_size)
    t0 = time.monotonic()
    try:
        num_here, fresh = await engine.call("reserve_prefix", request_id, hashes[:num_blocks])
    except (MemoryError, ValueError) as e:
        metrics.peer_pull_fallbacks.labels(type(e).__name__).inc()
        log.warning("no room to pull a prefix (%s)", e, extra={"request_id": request_id})
        await _release(state, kvp, request_id)  # its lease need not wait for its deadline
        return Pulled()
    filled, num_bytes = 0, 0
    try:
        filled, num_bytes = await _fetch(state, kvp, request_id, num_here, num_blocks, fresh)
    except BaseException:
        engine.post("commit_prefix", request_id, 0)  # cancelled: its blocks go back uncached
        raise
    await engine.call("commit_prefix", request_id, filled)
    num_tokens = filled * core.block_size
    metrics.peer_pulled_tokens.inc(num_tokens)
    return Pulled(num_tokens, num_bytes, time.monotonic() - t0)


async def _release(state: WorkerState, kvp: KVTransferParams, request_id: str) -> None:
    """Tell the holder of a verified handle that nothing will be pulled: its lease ends now."""
    try:
        peer = await state.connector.peer(kvp.remote_engine_id,
                                          f"http://{kvp.remote_host}:{kvp.remote_port}")
        await state.connector.notify(peer, kvp.remote_request_id)
    except Exception as e:  # noqa: BLE001 - best effort: the lease ends at its deadline anyway
        log.info("could not release a peer's prefix lease (%s)", e,
                 extra={"request_id": request_id})


async def _fetch(state: WorkerState, kvp: KVTransferParams, request_id: str, num_here: int,
                 num_blocks: int, fresh: list[int]) -> tuple[int, int]:
    """(blocks filled, bytes moved); (0, 0) on any failure, counted and logged."""
    connector = state.connector
    remote_rid = kvp.remote_request_id
    try:
        peer = await connector.peer(kvp.remote_engine_id,
                                    f"http://{kvp.remote_host}:{kvp.remote_port}")
        if not fresh:
            await connector.notify(peer, remote_rid)  # all here already: its lease may end
            return 0, 0
        staged_at = (kvp.model_extra or {}).get("remote_staging_start")  # signed with the handle
        slots = (list(range(staged_at + num_here, staged_at + num_blocks))
                 if type(staged_at) is int else None)
        stats = await connector.fetch(peer, remote_rid, kvp.remote_block_ids[num_here:num_blocks],
                                      fresh, staged_slots=slots)
        return len(fresh), stats.num_bytes
    except (TransferError, LayoutMismatch, BlockRangeError, ValueError) as e:
        timed_out = isinstance(e, TransferTimeout) or "timed out" in str(e)
        state.metrics.peer_pull_fallbacks.labels(
            "timeout" if timed_out else type(e).__name__).inc()
        log.warning("peer prefix pull failed (%s); computing the prompt", e,
                    extra={"request_id": request_id})
    except Exception as e:  # noqa: BLE001 - whatever a peer sent, the request goes on
        state.metrics.peer_pull_fallbacks.labels("error").inc()
        log.exception("peer prefix pull failed unexpectedly (%s)", e,
                      extra={"request_id": request_id})
    return 0, 0
