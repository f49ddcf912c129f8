"""NIXL transport: the whole KV cache is registered once; the receiver READs descriptor lists
straight out of the sender's registered region, then sends a notification that carries the
request id. UCX underneath picks RDMA, shared memory (cma) or TCP by itself.

A pull's fixed cost (bench/kv_transfer.py): descriptor lists are prepared once per peer, one
per block (a pull names indices; NIXL merges contiguous ones); the notification rides on the
READ; the sender's agent answers from its waiting progress thread (kv_transfer/nixl_agent.py);
the receiver polls without sleeping for its first `SPIN_S`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import logging
import os
import time
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, Field, ValidationError

from common.background import BackgroundErrors
from kv_transfer.descriptors import block_descriptors, coalesce, descriptor_arrays
from kv_transfer.layout import KVLayout
from kv_transfer.netdev import ucx_net_devices, ucx_read_transport
from kv_transfer.nixl_agent import import_nixl, make_agent, nixl_available  # noqa: F401 (re-exported)
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


class NixlTransport:
    name = "nixl"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self._agent = None
        self._reg = None
        self._peers: dict[str, str] = {}  # engine id -> NIXL agent name
        self._prepped: dict[str, object] = {}  # engine id -> its prepared remote descriptor list
        self._local_prepped = None  # this cache's, one descriptor per block
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self._label = "ucx"
        self.errors = BackgroundErrors()  # the connector hands its own in (one registry)

    async def start(self) -> None:
        nixl = import_nixl()
        if nixl is None:
            raise TransferError("NIXL is not installed (pip install nixl-cu12)")
        # UCX's TCP transport listens on every interface it may use: keep it to the worker's own
        # address (and RDMA ports), unless the operator chose the devices already.
        devices = ucx_net_devices(self.config.advertise_host or self.config.listen_host)
        if devices and "UCX_NET_DEVICES" not in os.environ:
            os.environ["UCX_NET_DEVICES"] = devices
            log.info("nixl: UCX limited to %s", devices)
        self._agent = make_agent(nixl, self.config.engine_id)  # kv_transfer/nixl_agent.py
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX backend")
        self._reg = self._agent.register_memory(self.kv_cache)
        if self.layout.num_blocks <= MAX_PREPPED_BLOCKS:
            self._local_prepped = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", block_descriptors(self.layout, self.kv_cache.data_ptr(), self.layout.num_blocks,
                                  self._device_id), self._mem_type)
        log.info("nixl: registered %.1f MiB of %s KV cache as agent %s",
                 self.layout.region_bytes / 2**20, self._mem_type, self.config.engine_id)

    async def close(self) -> None:
        if self._agent is not None:
            for engine_id in list(self._peers):
                try:
                    self.forget_peer(engine_id)
                except Exception:  # noqa: BLE001 - peer may be gone already
                    pass
            if self._local_prepped is not None:
                self._agent.release_dlist_handle(self._local_prepped)
                self._local_prepped = None
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
            self._agent = None
            self._peers.clear()

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
            },
        )

    def set_export_check(self, check) -> None:
        # One-sided READs never reach the sender's code; receivers bounds-check instead and
        # NIXL refuses addresses outside the registered region.
        pass

    @staticmethod
    def _params(peer: PeerMetadata) -> NixlParams:
        try:
            return NixlParams.model_validate(peer.params)
        except ValidationError as e:
            raise TransferError(f"invalid NIXL metadata from {peer.engine_id}: {e.errors()[0]['msg']}") from e

    def _agent_for(self, peer: PeerMetadata) -> str:
        name = self._peers.get(peer.engine_id)
        if name is None:
            try:
                md = base64.b64decode(self._params(peer).agent_metadata, validate=True)
            except binascii.Error as e:
                raise TransferError(f"invalid NIXL agent metadata from {peer.engine_id}") from e
            loaded = self._agent.add_remote_agent(md)
            name = loaded.decode() if isinstance(loaded, bytes) else loaded
            if name != peer.engine_id:
                # The agent inside must be the engine the verified handle named.
                self._agent.remove_remote_agent(name)
                raise TransferError(f"peer {peer.engine_id} sent the NIXL agent of {name!r}")
            self._peers[peer.engine_id] = name
        return name

    def forget_peer(self, engine_id: str) -> None:
        prepped = self._prepped.pop(engine_id, None)
        name = self._peers.pop(engine_id, None)
        if self._agent is None:
            return
        if prepped is not None:
            try:
                self._agent.release_dlist_handle(prepped)
            except Exception:  # noqa: BLE001 - the peer may be half gone
                pass
        if name is not None:
            self._agent.remove_remote_agent(name)

    def _remote_prepped(self, peer: PeerMetadata, params: NixlParams, agent_name: str):
        prepped = self._prepped.get(peer.engine_id)
        if prepped is None and self._local_prepped is not None \
                and peer.layout.num_blocks <= MAX_PREPPED_BLOCKS:
            prepped = self._agent.prep_xfer_dlist(
                agent_name, block_descriptors(self.layout, params.base_address, peer.layout.num_blocks,
                                  params.device_id), params.mem_type)
            self._prepped[peer.engine_id] = prepped
        return prepped

    def _start_read(self, peer: PeerMetadata, params: NixlParams, agent_name: str,
                    remote_block_ids: list[int], local_block_ids: list[int], notif: bytes):
        """(handle, descriptors) of a READ of the blocks, prepared lists where there are."""
        prepped = self._remote_prepped(peer, params, agent_name)
        if prepped is not None:
            handle = self._agent.make_prepped_xfer(
                "READ", self._local_prepped, np.asarray(local_block_ids, dtype=np.int32),
                prepped, np.asarray(remote_block_ids, dtype=np.int32), notif)
            return handle, len(coalesce(remote_block_ids, local_block_ids))
        runs = coalesce(remote_block_ids, local_block_ids)
        src, dst = descriptor_arrays(self.layout, params.base_address, self.kv_cache.data_ptr(),
                                     runs, params.device_id, self._device_id)
        remote = self._agent.get_xfer_descs(src, params.mem_type)
        local = self._agent.get_xfer_descs(dst, self._mem_type)
        return self._agent.initialize_xfer("READ", local, remote, agent_name, notif), len(runs)

    async def pull(
        self,
        peer: PeerMetadata,
        request_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> PullStats:
        assert self._agent is not None, "start() first"
        t0 = time.perf_counter()
        params = self._params(peer)
        handle = None
        try:
            agent_name = self._agent_for(peer)
            notif = _NOTIF_PREFIX + request_id.encode()  # delivered once the READ is done
            handle, num_descriptors = self._start_read(peer, params, agent_name, remote_block_ids,
                                                       local_block_ids, notif)
            state = self._agent.transfer(handle)
            spin_until = time.monotonic() + SPIN_S
            deadline = time.monotonic() + self.config.pull_timeout_s
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TransferTimeout(
                        f"NIXL read of {len(remote_block_ids)} blocks from {peer.engine_id} "
                        f"timed out after {self.config.pull_timeout_s} s")
                await asyncio.sleep(0 if now < spin_until else self.config.poll_interval_s)
                # Each check drives UCX a little (a few descriptors of a scattered read): a
                # burst of checks per turn of the event loop, not one, or a 256-block pull
                # pays a loop turn per descriptor.
                burst_until = time.monotonic() + BURST_S
                state = self._agent.check_xfer_state(handle)
                while state == "PROC" and time.monotonic() < burst_until:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL read from {peer.engine_id} failed (state {state})")
        except TransferError:
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
        self._refresh_label()
        return PullStats(
            num_blocks=len(remote_block_ids),
            num_bytes=len(remote_block_ids) * self.layout.bytes_per_block,
            seconds=time.perf_counter() - t0,
            num_descriptors=num_descriptors,
            transport_label=self._label,
        )

    async def notify(self, peer: PeerMetadata, request_id: str) -> None:
        """Tell the peer its blocks are no longer needed, without reading any."""
        try:
            self._agent.send_notif(self._agent_for(peer), _NOTIF_PREFIX + request_id.encode())
        except Exception as e:  # nixl raises its own exception types
            self.forget_peer(peer.engine_id)
            raise TransferError(f"NIXL notification to {peer.engine_id} failed: {e}") from e

    def _refresh_label(self) -> None:
        if self._label == "ucx" and self.config.ucx_proto_log:
            # UCX writes its log through stdio; flush every C stream of this process first.
            ctypes.CDLL(None).fflush(None)
            chosen = ucx_read_transport(self.config.ucx_proto_log)
            if chosen:
                self._label = f"ucx:{chosen}"
                log.info("nixl: UCX chose %s for remote reads", chosen)

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
