"""NIXL transport: the whole KV cache (and a bounded staging region beside it) is registered
once; the receiver READs descriptor lists straight out of the sender's registered memory, then
notifies the sender with the request id. UCX picks RDMA, cuda_ipc, shared memory (cma) or TCP;
its settings for VRAM are decided at start (ucx_config.py); the label names the lane it chose.

A pull is planned (pull_plan.py): one descriptor per run of blocks, or through staging slots
(staging.py) that the sender gathers an export into and/or the receiver READs into and scatters
from with the CUDA kernel. Per-peer work (validation, prepared lists) is done once (nixl_peers.py);
this process's prepared lists, and the READ handles built from both, are in nixl_reads.py.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import os
import time

import numpy as np
import torch

from common.background import BackgroundErrors
from kv_transfer import kernels, pull_plan, ucx_config
from kv_transfer.layout import BlockRangeError, KVLayout
from kv_transfer.netdev import ucx_net_devices
from kv_transfer.nixl_agent import (
    NOTIF_PREFIX,
    done_request_ids,
    finish_xfer,
    import_nixl,
    make_agent,
    nixl_available,  # noqa: F401 - imported from here
)
from kv_transfer.nixl_peers import MAX_PREPPED_BLOCKS, NixlPeer, NixlPeers
from kv_transfer.nixl_reads import LocalLists
from kv_transfer.pull_plan import PullPlan, plan_pull
from kv_transfer.side_stream import SideStream
from kv_transfer.staging import StagingPool
from kv_transfer.transport import PeerMetadata, PullStats, TransferError, TransportConfig

log = logging.getLogger(__name__)


class NixlTransport:
    name = "nixl"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self._agent = None
        self._regs: list[object] = []
        self._peers: NixlPeers | None = None  # engine id -> its agent, params, prepared lists
        self._lists: LocalLists | None = None  # this cache's and staging region's (after start)
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self._label = "ucx"
        self._ucx = ucx_config.UcxEnvironment(os.environ)
        self.costs = pull_plan.COSTS["cuda" if kv_cache.is_cuda else "cpu"]
        # READ parts of a pull into local slots
        self.pipeline_part_bytes = pull_plan.PIPELINE_PART_BYTES
        self.staging: StagingPool | None = None
        self._side: SideStream | None = None
        self._pull_ids = itertools.count()  # owners of a pull's local staging slots
        self.errors = BackgroundErrors()  # the connector hands its own in (one registry)

    async def start(self) -> None:
        nixl = import_nixl()
        if nixl is None:
            raise TransferError("NIXL is not installed (pip install nixl-cu12)")
        # The process environment is UCX's configuration: decided here, once, before the agent.
        self._ucx.enter(ucx_net_devices(self.config.advertise_host or self.config.listen_host),
                        self.kv_cache.is_cuda, self.config.ucx_proto_log)
        self._agent = make_agent(nixl, self.config.engine_id)  # kv_transfer/nixl_agent.py
        self._peers = NixlPeers(self._agent, self.layout)
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX backend")
        self._regs.append(self._agent.register_memory(self.kv_cache))
        self._lists = LocalLists(self._agent, self.layout, self.kv_cache, self._mem_type,
                                 self._device_id)
        if self.layout.num_blocks <= MAX_PREPPED_BLOCKS:
            self._lists.blocks = self._lists.prep(self.kv_cache, self.layout.num_blocks)
        num_slots = min(self.config.staging_bytes // self.layout.bytes_per_block,
                        self.layout.num_blocks)
        # On CPU caches `auto` never stages (a copy costs what the transfer does): no pool.
        wanted = (self.config.staging == "always"
                  or (self.config.staging == "auto" and self.kv_cache.is_cuda))
        if wanted and num_slots >= 1 and self._lists.blocks is not None:
            self.staging = StagingPool(self.kv_cache, num_slots)
            self._regs.append(self._agent.register_memory(self.staging.buffer))
            self._lists.slots = self._lists.prep(self.staging.buffer, num_slots)
            self._side = SideStream(self.kv_cache.device)
        log.info("nixl: registered %.1f MiB of %s KV cache (+%d staging slots, %s) as agent %s",
                 self.layout.region_bytes / 2**20, self._mem_type,
                 num_slots if self.staging is not None else 0, self.config.staging,
                 self.config.engine_id)

    async def close(self) -> None:
        if self._agent is not None:
            self._peers.clear()
            self._lists.release()
            for reg in self._regs:
                self._agent.deregister_memory(reg)
            self._regs.clear()
            self._agent = None
        self._ucx.exit()

    @property
    def label(self) -> str:
        return self._label

    def metadata(self) -> PeerMetadata:
        assert self._agent is not None, "start() first"
        md = self._agent.get_agent_metadata()
        return PeerMetadata(
            engine_id=self.config.engine_id,
            transport=self.name,
            layout=self.layout,
            params={
                "agent_metadata": base64.b64encode(md).decode(),
                "base_address": self.kv_cache.data_ptr(),
                "mem_type": self._mem_type,
                "device_id": self._device_id,
                "staging_address": 0 if self.staging is None else self.staging.buffer.data_ptr(),
                "staging_num_blocks": self.staging.num_slots if self.staging is not None else 0,
            },
        )

    def set_export_check(self, check) -> None:
        # One-sided READs never reach the sender's code; receivers bounds-check instead and
        # NIXL refuses addresses outside the registered regions.
        pass

    # ---- sending side: staging an export ----------------------------------------------------

    def stage(self, request_id: str, block_ids: list[int]) -> int | None:
        """Gather an export's blocks into staging slots when the plan says it pays; returns the
        first slot (the blocks follow in order) or None (no staging: read where they are)."""
        if self.staging is None or not pull_plan.stage_at_export(
                block_ids, self.layout.bytes_per_block, self.costs, self.config.staging):
            return None
        return self.staging.stage(request_id, self.kv_cache, block_ids, self._side)

    def unstage(self, request_id: str) -> bool:
        return self.staging is not None and self.staging.release(request_id)

    # ---- receiving side ---------------------------------------------------------------------

    def _peer(self, peer: PeerMetadata) -> NixlPeer:
        return self._peers.get(peer, self._lists.blocks is not None)

    def forget_peer(self, engine_id: str) -> None:
        if self._peers is not None:
            self._peers.forget(engine_id)

    def plan(self, peer: PeerMetadata, remote_block_ids, local_block_ids,
             staged_slots) -> PullPlan:
        """How this pull will go (kv_transfer/pull_plan.py), given what both sides have. The ids
        may be lists or int arrays (a pull converts them once)."""
        known = self._peers.known(peer.engine_id)
        prepped = known is not None and known.blocks is not None
        slots = staged_slots if prepped and known.slots is not None else None
        free = (self.staging is not None and self._lists.slots is not None and prepped
                and len(remote_block_ids) <= self.staging.num_slots - self.staging.num_leased_slots)
        return plan_pull(remote_block_ids, local_block_ids, self.layout.bytes_per_block, self.costs,
                         self.config.staging, slots, free)

    async def pull(self, peer: PeerMetadata, request_id: str, remote_block_ids: list[int],
                   local_block_ids: list[int], staged_slots: list[int] | None = None) -> PullStats:
        """READ the blocks as planned (into local slots in parts, each scattered while later ones
        are read), then notify the sender: after the READ, not riding on it (UCX flushed the lane
        first, ~40 us of a 1-block pull's 80 on the H200). `extra["phases_us"]`: prepare, read
        (with all scatters but the last), scatter (the rest), notify."""
        assert self._agent is not None, "start() first"
        t0 = time.perf_counter()
        handles: list = []
        local_lease = None
        marks = [t0]
        try:
            known = self._peer(peer)
            # Arrays once, for the planner and the READ (4,096-id lists cost ~1 ms converted twice).
            remote = np.asarray(remote_block_ids, dtype=np.int32)
            local = np.asarray(local_block_ids, dtype=np.int32)
            slots = None if staged_slots is None else known.check_slots(staged_slots, len(remote))
            plan = self.plan(peer, remote, local, slots)
            if plan.stages_locally:
                local_lease = self.staging.lease(f"pull:{next(self._pull_ids)}", len(remote))
                if local_lease is None:  # taken meanwhile
                    plan = plan_pull(remote, local, self.layout.bytes_per_block,
                                     self.costs, "never")
            parts = ([(0, len(remote))] if local_lease is None else
                     pull_plan.pipeline_parts(len(remote), self.layout.bytes_per_block,
                                              self.pipeline_part_bytes))
            for first, count in parts:
                end = first + count
                handles.append(self._lists.read(known, plan, remote[first:end], local[first:end],
                                                None if slots is None else slots[first:end],
                                                local_lease, first))
            marks.append(time.perf_counter())
            states = [self._agent.transfer(handle) for handle in handles]  # all posted at once
            deadline = time.monotonic() + self.config.pull_timeout_s
            for (first, count), handle, state in zip(parts, handles, states, strict=True):
                await finish_xfer(self._agent, handle, state, max(deadline - time.monotonic(), 0.0),
                                  self.config.poll_interval_s,
                                  f"NIXL read of {len(remote)} blocks from {peer.engine_id}")
                if local_lease is not None:  # this part has landed: scatter it meanwhile
                    with self._side:
                        kernels.scatter_blocks(self.kv_cache, local[first:first + count],
                                               self.staging.view(local_lease)[first:first + count])
            marks.append(time.perf_counter())
            if local_lease is not None:
                await SideStream.wait(self._side.record())
            marks.append(time.perf_counter())
            # Blocks here: the notification (it only frees the sender's lease) goes next turn.
            asyncio.get_running_loop().call_soon(self._notify_done, known.agent_name,
                                                 peer.engine_id, NOTIF_PREFIX + request_id.encode())
            marks.append(time.perf_counter())
        except (TransferError, BlockRangeError, ValueError):
            self.forget_peer(peer.engine_id)
            raise
        except Exception as e:  # nixl raises its own exception types
            self.forget_peer(peer.engine_id)
            raise TransferError(f"NIXL read from {peer.engine_id} failed: {e}") from e
        finally:
            for handle in handles:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - releasing a failed request may fail too
                    pass
            if local_lease is not None:
                if len(marks) < 5:  # failed: no scatter may still read the slots given back
                    self._side.synchronize()
                self.staging.release(local_lease.owner)
        self._refresh_label(peer.engine_id)
        phases = {name: round((marks[i + 1] - marks[i]) * 1e6, 1)
                  for i, name in enumerate(("prepare", "read", "scatter", "notify"))}
        return PullStats(
            num_blocks=len(remote),
            num_bytes=len(remote) * self.layout.bytes_per_block,
            seconds=time.perf_counter() - t0,
            num_descriptors=plan.num_descriptors,
            transport_label=self._label,
            extra={"plan": plan.kind, "phases_us": phases},
        )

    def _notify_done(self, agent_name: str, engine_id: str, message: bytes) -> None:
        if self._agent is None:
            return  # closed meanwhile: the sender's lease expires instead
        try:
            self._agent.send_notif(agent_name, message)
        except Exception as e:  # noqa: BLE001 - the pull has returned; its lease will expire
            self.errors.record("kv_notifications", f"notification to {engine_id} failed: {e}")
            self.forget_peer(engine_id)

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        """Tell the peer its blocks are no longer needed, without reading any."""
        try:
            self._agent.send_notif(self._peer(peer).agent_name, NOTIF_PREFIX + request_id.encode())
        except TransferError:
            self.forget_peer(peer.engine_id)
            raise
        except Exception as e:  # nixl raises its own exception types
            self.forget_peer(peer.engine_id)
            raise TransferError(f"NIXL notification to {peer.engine_id} failed: {e}") from e

    def _refresh_label(self, engine_id: str) -> None:
        """The lane UCX chose, read from its log after the first pull from each peer."""
        known = self._peers.known(engine_id)
        if self._ucx.log is None or known is None or known.label_known:
            return
        lane = self._ucx.log.refresh()
        if lane:
            known.label_known = True
            if self._label != f"ucx:{lane}":
                self._label = f"ucx:{lane}"
                log.info("nixl: UCX chose %s for remote reads from %s", lane, engine_id)

    def completed(self) -> list[str]:
        return ([] if self._agent is None
                else done_request_ids(self._agent.get_new_notifs(), self.errors))
