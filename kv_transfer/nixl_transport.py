"""NIXL transport: the whole KV cache (and a bounded staging region beside it) is registered
once; the receiver READs descriptor lists straight out of the sender's registered memory, then
notifies the sender with the request id. UCX picks RDMA, cuda_ipc, shared memory (cma) or TCP;
the settings it needs for VRAM are decided at start (kv_transfer/ucx_config.py) and the label
names the lane it chose (`ucx:cuda_ipc`, `ucx:cma`, ...).

How a pull moves its blocks is planned per pull (kv_transfer/pull_plan.py): one descriptor per
run of blocks (few blocks, CPU caches), or through staging slots (kv_transfer/staging.py): the
sender gathers an export into its slots when the lease is granted, the receiver READs one range
into its own slots and scatters them with the CUDA kernel.

A pull's fixed cost: prepared descriptor lists and validated parameters per peer
(nixl_peers.py), back-to-back polling first, a waiting progress thread (nixl_agent.py).
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import time

import numpy as np
import torch

from common.background import BackgroundErrors
from kv_transfer import kernels, ucx_config
from kv_transfer.descriptors import block_descriptors, coalesce, descriptor_arrays
from kv_transfer.layout import BlockRangeError, KVLayout
from kv_transfer.netdev import ucx_net_devices
from kv_transfer.nixl_agent import import_nixl, make_agent, nixl_available, wait_xfer  # noqa: F401
from kv_transfer.nixl_peers import MAX_PREPPED_BLOCKS, NixlPeer, NixlPeers
from kv_transfer.pull_plan import COSTS, PullPlan, plan_pull, stage_at_export
from kv_transfer.side_stream import SideStream
from kv_transfer.staging import StagingPool
from kv_transfer.transport import PeerMetadata, PullStats, TransferError, TransportConfig

log = logging.getLogger(__name__)

_NOTIF_PREFIX = b"tandem:done:"


class NixlTransport:
    name = "nixl"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self._agent = None
        self._regs: list[object] = []
        self._peers: NixlPeers | None = None  # engine id -> its agent, params, prepared lists
        self._local_blocks = None  # this cache's prepared list, one descriptor per block
        self._local_slots = None  # this staging region's
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self._label = "ucx"
        self._ucx = ucx_config.UcxEnvironment(os.environ)
        self.costs = COSTS["cuda" if kv_cache.is_cuda else "cpu"]
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
        if self.layout.num_blocks <= MAX_PREPPED_BLOCKS:
            self._local_blocks = self._prep_local(self.kv_cache, self.layout.num_blocks)
        num_slots = min(self.config.staging_bytes // self.layout.bytes_per_block, self.layout.num_blocks)
        # On CPU caches `auto` never stages (a copy costs what the transfer does): no pool.
        wanted = self.config.staging == "always" or (self.config.staging == "auto" and self.kv_cache.is_cuda)
        if wanted and num_slots >= 1 and self._local_blocks is not None:
            self.staging = StagingPool(self.kv_cache, num_slots)
            self._regs.append(self._agent.register_memory(self.staging.buffer))
            self._local_slots = self._prep_local(self.staging.buffer, num_slots)
            self._side = SideStream(self.kv_cache.device)
        log.info("nixl: registered %.1f MiB of %s KV cache (+%d staging slots, %s) as agent %s",
                 self.layout.region_bytes / 2**20, self._mem_type, num_slots if self.staging is not None else 0,
                 self.config.staging, self.config.engine_id)

    def _prep_local(self, region: torch.Tensor, num_blocks: int):
        return self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", block_descriptors(self.layout, region.data_ptr(), num_blocks,
                                                 self._device_id), self._mem_type)

    async def close(self) -> None:
        if self._agent is not None:
            self._peers.clear()
            for prepped in (self._local_blocks, self._local_slots):
                if prepped is not None:
                    self._agent.release_dlist_handle(prepped)
            self._local_blocks = self._local_slots = None
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
        if self.staging is None or not stage_at_export(block_ids, self.layout.bytes_per_block,
                                                       self.costs, self.config.staging):
            return None
        lease = self.staging.lease(request_id, len(block_ids))
        if lease is None:
            return None  # full: this export is read block by block
        try:
            with self._side:
                kernels.gather_blocks(self.kv_cache, block_ids, out=self.staging.view(lease))
            self._side.synchronize()  # ~50 us for 256 blocks; a READ may come at once
        except BaseException:
            self.staging.release(request_id)
            raise
        return lease.start

    def unstage(self, request_id: str) -> bool:
        return self.staging is not None and self.staging.release(request_id)

    # ---- receiving side ---------------------------------------------------------------------

    def _peer(self, peer: PeerMetadata) -> NixlPeer:
        return self._peers.get(peer, self._local_blocks is not None)

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
        free = (self.staging is not None and self._local_slots is not None and prepped
                and len(remote_block_ids) <= self.staging.num_slots - self.staging.num_leased_slots)
        return plan_pull(remote_block_ids, local_block_ids, self.layout.bytes_per_block, self.costs,
                         self.config.staging, slots, free)

    async def pull(self, peer: PeerMetadata, request_id: str, remote_block_ids: list[int],
                   local_block_ids: list[int], staged_slots: list[int] | None = None) -> PullStats:
        """READ the blocks (as planned), scatter them if they landed in staging slots, then
        notify the sender. The notification is its own message after the data is here: riding
        on the READ it made UCX flush the lane first, ~40 us of a 1-block pull's 80 (H200) and
        ~60 us on CPU. `extra["phases_us"]`: where the time went (prepare, read, scatter, notify)."""
        assert self._agent is not None, "start() first"
        t0 = time.perf_counter()
        handle = None
        local_lease = None
        marks = [t0]
        try:
            known = self._peer(peer)
            # One conversion per pull: the planner and the prepared READ take the same arrays
            # (lists of 4,096 ids cost ~1 ms of Python a pull when converted at each step).
            remote = np.asarray(remote_block_ids, dtype=np.int32)
            local = np.asarray(local_block_ids, dtype=np.int32)
            slots = None if staged_slots is None else known.check_slots(staged_slots, len(remote))
            plan = self.plan(peer, remote, local, slots)
            if plan.stages_locally:
                local_lease = self.staging.lease(f"pull:{next(self._pull_ids)}", len(remote))
                if local_lease is None:  # taken meanwhile
                    plan = plan_pull(remote, local, self.layout.bytes_per_block, self.costs, "never")
            handle = self._make_read(known, plan, remote, local, slots, local_lease)
            marks.append(time.perf_counter())
            await wait_xfer(self._agent, handle, self.config.pull_timeout_s, self.config.poll_interval_s,
                            f"NIXL read of {len(remote)} blocks from {peer.engine_id}")
            marks.append(time.perf_counter())
            if local_lease is not None:
                with self._side:
                    kernels.scatter_blocks(self.kv_cache, local, self.staging.view(local_lease))
                await SideStream.wait(self._side.record())
            marks.append(time.perf_counter())
            self._agent.send_notif(known.agent_name, _NOTIF_PREFIX + request_id.encode())
            marks.append(time.perf_counter())
        except (TransferError, BlockRangeError, ValueError):
            self.forget_peer(peer.engine_id)
            raise
        except Exception as e:  # nixl raises its own exception types
            self.forget_peer(peer.engine_id)
            raise TransferError(f"NIXL read from {peer.engine_id} failed: {e}") from e
        finally:
            if handle is not None:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - releasing a failed request may fail too
                    pass
            if local_lease is not None:
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

    def _make_read(self, known: NixlPeer, plan: PullPlan, remote: np.ndarray, local: np.ndarray,
                   slots: np.ndarray | None, local_lease):
        """The READ handle of `plan` (no notification: pull sends it after): indices into
        prepared lists where there are (NIXL merges consecutive rows into one descriptor)."""
        n = len(remote)
        if known.blocks is None:  # too many blocks to prepare: this pull's own list
            runs = coalesce(remote.tolist(), local.tolist())
            src, dst = descriptor_arrays(self.layout, known.params.base_address, self.kv_cache.data_ptr(),
                                         runs, known.params.device_id, self._device_id)
            return self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(dst, self._mem_type),
                self._agent.get_xfer_descs(src, known.params.mem_type), known.agent_name, b"")
        remote_list, remote_idx = (known.slots, slots) if plan.reads_staged_source else (known.blocks, remote)
        if local_lease is not None:
            local_list = self._local_slots
            local_idx = np.arange(local_lease.start, local_lease.start + n, dtype=np.int32)
        else:
            local_list, local_idx = self._local_blocks, local
        return self._agent.make_prepped_xfer("READ", local_list, local_idx, remote_list, remote_idx, b"")

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        """Tell the peer its blocks are no longer needed, without reading any."""
        try:
            self._agent.send_notif(self._peer(peer).agent_name, _NOTIF_PREFIX + request_id.encode())
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
        if self._agent is None:
            return []
        done: list[str] = []
        for messages in self._agent.get_new_notifs().values():
            for msg in messages:
                # Any peer that loaded our metadata can send anything: one bad message is
                # skipped (and counted), never the end of the lease watcher.
                if not msg.startswith(_NOTIF_PREFIX):
                    self.errors.record("kv_notifications", f"unknown notification {msg[:64]!r}")
                    continue
                try:
                    request_id = msg[len(_NOTIF_PREFIX):].decode("ascii")
                except UnicodeDecodeError:
                    self.errors.record("kv_notifications", f"undecodable notification {msg[:64]!r}")
                    continue
                done.append(request_id)
        return done

