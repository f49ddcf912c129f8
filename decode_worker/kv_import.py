"""The decode side of a KV transfer: check a prefill worker's signed handle, then pull the blocks
this worker lacks through the KV connector (docs/contract.md request path, step 6). A failed pull
(worker/generation.py) is prefilled locally or fails the request cleanly, by the worker's
--kv-pull-failure-policy; nothing a peer sends can do more."""

from __future__ import annotations

import logging

from common.protocol import KVTransferParams
from kv_transfer import handle
from kv_transfer.layout import BlockRangeError, LayoutMismatch
from kv_transfer.transport import TransferError, TransferTimeout
from worker.state import WorkerState

log = logging.getLogger(__name__)


class BlockImporter:
    """`worker.role.KVImporter` over the worker's `KVConnector` (NIXL or TCP)."""

    def accepts(self, state: WorkerState, kvp: KVTransferParams, prompt: list[int],
                request_id: str, cache_salt: str | None = None) -> bool:
        """Signed by a holder of the internal token, unexpired, and issued for exactly this
        prompt's blocks under its cache salt (kv_transfer/handle.py)."""
        s = state.settings
        try:
            handle.verify(kvp, s.internal_token, prompt,
                          state.core.hasher(prompt, cache_salt=cache_salt),
                          s.require_signed_handles)
        except handle.InvalidHandle as e:
            state.metrics.pull_fallbacks.labels("invalid_handle").inc()
            log.warning("refused a KV handle (%s); prefilling locally", e,
                        extra={"request_id": request_id})
            return False
        return True

    async def pull(self, state: WorkerState, kvp: KVTransferParams, request_id: str,
                   block_table: list[int], num_local: int, num_kv_tokens: int) -> tuple[bool, int]:
        connector, core = state.connector, state.core
        num_kv_blocks = -(-num_kv_tokens // core.block_size)
        remote = kvp.remote_block_ids or []
        remote_rid = kvp.remote_request_id or request_id
        try:
            if len(remote) < num_kv_blocks or not kvp.remote_host or kvp.remote_port is None:
                raise TransferError(f"kv_transfer_params name {len(remote)} blocks and "
                                    f"{kvp.remote_host}:{kvp.remote_port}; "
                                    f"{num_kv_blocks} blocks needed")
            peer = await connector.peer(kvp.remote_engine_id,
                                        f"http://{kvp.remote_host}:{kvp.remote_port}")
            if num_local >= num_kv_blocks:
                await connector.notify(peer, remote_rid)
                return True, 0
            # signed with the handle
            staged_at = (kvp.model_extra or {}).get("remote_staging_start")
            slots = (list(range(staged_at + num_local, staged_at + num_kv_blocks))
                     if type(staged_at) is int else None)
            stats = await connector.fetch(peer, remote_rid, remote[num_local:num_kv_blocks],
                                          block_table[num_local:num_kv_blocks], staged_slots=slots)
            return True, stats.num_bytes
        except (TransferError, LayoutMismatch, BlockRangeError, ValueError) as e:
            timed_out = isinstance(e, TransferTimeout) or "timed out" in str(e)
            state.metrics.pull_fallbacks.labels("timeout" if timed_out else type(e).__name__).inc()
            log.warning("KV pull failed (%s)", e, extra={"request_id": request_id})
        except Exception as e:  # noqa: BLE001 - whatever a peer sent, the request goes on
            state.metrics.pull_fallbacks.labels("error").inc()
            log.exception("KV pull failed unexpectedly (%s)", e, extra={"request_id": request_id})
        # A peer that only had to be told its lease can end (every block was here) failed nothing.
        return num_local >= num_kv_blocks, 0
