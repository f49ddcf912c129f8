"""NIXL transport: the whole KV cache (and a bounded staging region beside it) is registered
once; the receiver READs descriptor lists straight out of the sender's registered memory, then
notifies the sender with the request id. UCX picks RDMA, cuda_ipc, shared memory (cma) or TCP;
the settings it needs for VRAM are decided at start (kv_transfer/ucx_config.py) and the label
names the lane it chose (`ucx:cuda_ipc`, `ucx:cma`, ...).

How a pull moves its blocks is planned per pull (kv_transfer/pull_plan.py): one descriptor per
run of blocks (few blocks, CPU caches), or through staging slots (kv_transfer/staging.py): the
sender gathers an export into its slots when the lease is granted, the receiver READs one range
into its own slots and scatters them with the CUDA kernel.

A pull's fixed cost: descriptor lists are prepared once per peer (cache blocks and staging
slots, one entry per block; a pull names indices and NIXL merges contiguous ones); a peer's
validated parameters are cached with it; the receiver polls back to back for its first
`SPIN_S`; the sender's agent answers from its waiting progress thread (nixl_agent.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, Field, ValidationError

from common.background import BackgroundErrors
from kv_transfer import kernels, ucx_config
from kv_transfer.descriptors import block_descriptors, coalesce, descriptor_arrays
from kv_transfer.layout import BlockRangeError, KVLayout
from kv_transfer.netdev import ucx_net_devices
from kv_transfer.nixl_agent import import_nixl, make_agent, nixl_available  # noqa: F401 (re-exported)
from kv_transfer.pull_plan import COSTS, PullPlan, plan_pull, stage_at_export
from kv_transfer.side_stream import SideStream
from kv_transfer.staging import StagingPool
from kv_transfer.transport import (
    PeerMetadata,
    PullStats,
    TransferError,
    TransferTimeout,
    TransportConfig,
)

log = logging.getLogger(__name__)

_NOTIF_PREFIX = b"tandem:done:"
SPIN_S = 0.002  # poll a running READ back to back this long, then every poll_interval_s
BURST_S = 0.0002  # the longest one poll holds the event loop
MAX_PREPPED_BLOCKS = 1 << 20  # a peer with more blocks is read with per-pull descriptor lists


class NixlParams(BaseModel):
    """A NIXL peer's `params` in its metadata document, validated before any is used."""

    agent_metadata: str = Field(max_length=1 << 20)
    base_address: int = Field(ge=0, lt=2**64)
    mem_type: Literal["DRAM", "VRAM"]
    device_id: int = Field(0, ge=0, le=1024)
    staging_address: int = Field(0, ge=0, lt=2**64)
    staging_num_blocks: int = Field(0, ge=0, le=1 << 31)


@dataclass
class _Peer:
    agent_name: str
    params: NixlParams
    blocks: object | None = None  # prepared descriptor list of its cache blocks
    slots: object | None = None  # and of its staging slots
    label_known: bool = False


class NixlTransport:
    name = "nixl"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self._agent = None
        self._regs: list[object] = []
        self._peers: dict[str, _Peer] = {}  # engine id -> its agent, params, prepared lists
        self._local_blocks = None  # this cache's prepared list, one descriptor per block
        self._local_slots = None  # this staging region's
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self._label = "ucx"
        self._ucx_log: ucx_config.UcxLog | None = None
        self._log_dir: str | None = None
        self._ucx_settings: ucx_config.UcxSettings | None = None
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
        if self.config.ucx_proto_log is None and "UCX_LOG_FILE" not in os.environ:
            self._log_dir = tempfile.mkdtemp(prefix="tandem-ucx-")
        settings = ucx_config.decide(
            os.environ, ucx_net_devices(self.config.advertise_host or self.config.listen_host),
            vram=self.kv_cache.is_cuda, proto_log=self.config.ucx_proto_log, log_dir=self._log_dir)
        ucx_config.apply(settings, os.environ)
        self._ucx_settings = settings
        if settings.log_file:
            self._ucx_log = ucx_config.UcxLog(settings.log_file, "cuda" if self.kv_cache.is_cuda else "host")
        self._agent = make_agent(nixl, self.config.engine_id)  # kv_transfer/nixl_agent.py
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
            for engine_id in list(self._peers):
                try:
                    self.forget_peer(engine_id)
                except Exception:  # noqa: BLE001 - peer may be gone already
                    pass
            for prepped in (self._local_blocks, self._local_slots):
                if prepped is not None:
                    self._agent.release_dlist_handle(prepped)
            self._local_blocks = self._local_slots = None
            for reg in self._regs:
                self._agent.deregister_memory(reg)
            self._regs.clear()
            self._agent = None
        if self._ucx_settings is not None:
            ucx_config.restore(self._ucx_settings, os.environ)
            self._ucx_settings = None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)  # UCX keeps its open descriptor
            self._log_dir = None

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

    def _peer(self, peer: PeerMetadata) -> _Peer:
        known = self._peers.get(peer.engine_id)
        if known is not None:
            return known
        try:
            params = NixlParams.model_validate(peer.params)
        except ValidationError as e:
            raise TransferError(f"invalid NIXL metadata from {peer.engine_id}: {e.errors()[0]['msg']}") from e
        try:
            md = base64.b64decode(params.agent_metadata, validate=True)
        except binascii.Error as e:
            raise TransferError(f"invalid NIXL agent metadata from {peer.engine_id}") from e
        loaded = self._agent.add_remote_agent(md)
        name = loaded.decode() if isinstance(loaded, bytes) else loaded
        if name != peer.engine_id:
            # The agent inside must be the engine the verified handle named.
            self._agent.remove_remote_agent(name)
            raise TransferError(f"peer {peer.engine_id} sent the NIXL agent of {name!r}")
        known = _Peer(name, params)
        self._peers[peer.engine_id] = known
        try:
            if self._local_blocks is not None and peer.layout.num_blocks <= MAX_PREPPED_BLOCKS:
                known.blocks = self._agent.prep_xfer_dlist(
                    name, block_descriptors(self.layout, params.base_address, peer.layout.num_blocks,
                                            params.device_id), params.mem_type)
                if params.staging_num_blocks and params.staging_address:
                    known.slots = self._agent.prep_xfer_dlist(
                        name, block_descriptors(self.layout, params.staging_address,
                                                params.staging_num_blocks, params.device_id),
                        params.mem_type)
        except Exception:
            self.forget_peer(peer.engine_id)
            raise
        return known

    def forget_peer(self, engine_id: str) -> None:
        known = self._peers.pop(engine_id, None)
        if self._agent is None or known is None:
            return
        for prepped in (known.blocks, known.slots):
            if prepped is not None:
                try:
                    self._agent.release_dlist_handle(prepped)
                except Exception:  # noqa: BLE001 - the peer may be half gone
                    pass
        self._agent.remove_remote_agent(known.agent_name)

    def plan(self, peer: PeerMetadata, remote_block_ids: list[int], local_block_ids: list[int],
             staged_slots: list[int] | None) -> PullPlan:
        """How this pull will go (kv_transfer/pull_plan.py), given what both sides have."""
        known = self._peers.get(peer.engine_id)
        prepped = known is not None and known.blocks is not None
        slots = staged_slots if prepped and known.slots is not None else None
        free = (self.staging is not None and self._local_slots is not None and prepped
                and len(remote_block_ids) <= self.staging.num_slots - self.staging.num_leased_slots)
        return plan_pull(remote_block_ids, local_block_ids, self.layout.bytes_per_block, self.costs,
                         self.config.staging, slots, free)

    def _check_slots(self, known: _Peer, staged_slots: list[int], n: int) -> None:
        limit = known.params.staging_num_blocks
        if len(staged_slots) != n:
            raise ValueError("staged slots and remote blocks differ in length")
        if staged_slots and (min(staged_slots) < 0 or max(staged_slots) >= limit):
            raise BlockRangeError(f"staged slots out of the peer's range [0, {limit})")

    async def pull(
        self,
        peer: PeerMetadata,
        request_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        staged_slots: list[int] | None = None,
    ) -> PullStats:
        assert self._agent is not None, "start() first"
        t0 = time.perf_counter()
        handle = None
        local_lease = None
        try:
            known = self._peer(peer)
            if staged_slots is not None:
                self._check_slots(known, staged_slots, len(remote_block_ids))
            plan = self.plan(peer, remote_block_ids, local_block_ids, staged_slots)
            if plan.stages_locally:
                local_lease = self.staging.lease(f"pull:{next(self._pull_ids)}", len(remote_block_ids))
                if local_lease is None:  # taken meanwhile
                    plan = plan_pull(remote_block_ids, local_block_ids, self.layout.bytes_per_block,
                                     self.costs, "never")
            notif = _NOTIF_PREFIX + request_id.encode()
            # The notification rides on the READ (UCX sends it once the data is here) unless a
            # scatter follows; then it is sent after.
            handle = self._make_read(known, plan, remote_block_ids, local_block_ids, staged_slots,
                                     local_lease, b"" if local_lease is not None else notif)
            await self._run(handle, peer, len(remote_block_ids))
            if local_lease is not None:
                with self._side:
                    kernels.scatter_blocks(self.kv_cache, local_block_ids, self.staging.view(local_lease))
                await SideStream.wait(self._side.record())
                self._agent.send_notif(known.agent_name, notif)
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
        return PullStats(
            num_blocks=len(remote_block_ids),
            num_bytes=len(remote_block_ids) * self.layout.bytes_per_block,
            seconds=time.perf_counter() - t0,
            num_descriptors=plan.num_descriptors,
            transport_label=self._label,
            extra={"plan": plan.kind},
        )

    def _make_read(self, known: _Peer, plan: PullPlan, remote_block_ids, local_block_ids,
                   staged_slots, local_lease, notif: bytes):
        """The READ handle of `plan`: indices into prepared lists where there are."""
        n = len(remote_block_ids)
        if known.blocks is None:  # too many blocks to prepare: this pull's own list
            runs = coalesce(remote_block_ids, local_block_ids)
            src, dst = descriptor_arrays(self.layout, known.params.base_address, self.kv_cache.data_ptr(),
                                         runs, known.params.device_id, self._device_id)
            return self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(dst, self._mem_type),
                self._agent.get_xfer_descs(src, known.params.mem_type), known.agent_name, notif)
        remote_list, remote_idx = ((known.slots, staged_slots) if plan.reads_staged_source
                                   else (known.blocks, remote_block_ids))
        if local_lease is not None:
            local_list, local_idx = self._local_slots, range(local_lease.start, local_lease.start + n)
        else:
            local_list, local_idx = self._local_blocks, local_block_ids
        return self._agent.make_prepped_xfer(
            "READ", local_list, np.asarray(local_idx, dtype=np.int32),
            remote_list, np.asarray(remote_idx, dtype=np.int32), notif)

    async def _run(self, handle, peer: PeerMetadata, num_blocks: int) -> None:
        agent = self._agent
        state = agent.transfer(handle)
        now = time.monotonic()
        spin_until, deadline = now + SPIN_S, now + self.config.pull_timeout_s
        # Back to back first: a 1-block READ on cuda_ipc is done in tens of microseconds.
        while state == "PROC" and time.monotonic() < spin_until:
            state = agent.check_xfer_state(handle)
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"NIXL read of {num_blocks} blocks from {peer.engine_id} "
                    f"timed out after {self.config.pull_timeout_s} s")
            await asyncio.sleep(self.config.poll_interval_s)
            # Each check drives UCX a little (a few descriptors of a scattered read): a burst
            # of checks per turn of the event loop, not one.
            burst_until = time.monotonic() + BURST_S
            state = agent.check_xfer_state(handle)
            while state == "PROC" and time.monotonic() < burst_until:
                state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"NIXL read from {peer.engine_id} failed (state {state})")

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
        known = self._peers.get(engine_id)
        if self._ucx_log is None or known is None or known.label_known:
            return
        lane = self._ucx_log.refresh()
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

