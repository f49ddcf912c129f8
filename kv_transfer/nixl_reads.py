"""This process's side of a NIXL READ: the descriptor lists of its KV cache (one descriptor per
block) and of its staging slots, prepared once, and the READ handles built from them and a peer's
lists (nixl_peers.py)."""

from __future__ import annotations

import numpy as np
import torch

from kv_transfer.descriptors import block_descriptors, coalesce, descriptor_arrays
from kv_transfer.layout import KVLayout
from kv_transfer.nixl_peers import NixlPeer
from kv_transfer.pull_plan import PullPlan


class LocalLists:
    """The prepared lists of this process's registered memory: `blocks` (None when the cache has
    too many blocks to prepare) and `slots` (None without a staging region)."""

    def __init__(self, agent, layout: KVLayout, kv_cache: torch.Tensor, mem_type: str,
                 device_id: int) -> None:
        self._agent = agent
        self.layout = layout
        self.kv_cache = kv_cache
        self.mem_type = mem_type
        self.device_id = device_id
        self.blocks = None
        self.slots = None

    def prep(self, region: torch.Tensor, num_blocks: int):
        return self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", block_descriptors(self.layout, region.data_ptr(), num_blocks,
                                                 self.device_id), self.mem_type)

    def release(self) -> None:
        for prepped in (self.blocks, self.slots):
            if prepped is not None:
                self._agent.release_dlist_handle(prepped)
        self.blocks = self.slots = None

    def read(self, known: NixlPeer, plan: PullPlan, remote: np.ndarray, local: np.ndarray,
             slots: np.ndarray | None, local_lease, offset: int = 0):
        """The READ handle of `plan` (no notification: pull sends it after): indices into
        prepared lists where there are (NIXL merges consecutive rows into one descriptor)."""
        if known.blocks is None:  # too many blocks to prepare: this pull's own list
            runs = coalesce(remote.tolist(), local.tolist())
            src, dst = descriptor_arrays(self.layout, known.params.base_address,
                                         self.kv_cache.data_ptr(), runs, known.params.device_id,
                                         self.device_id)
            return self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(dst, self.mem_type),
                self._agent.get_xfer_descs(src, known.params.mem_type), known.agent_name, b"")
        remote_list, remote_idx = ((known.slots, slots) if plan.reads_staged_source
                                   else (known.blocks, remote))
        if local_lease is not None:
            local_list = self.slots
            start = local_lease.start + offset
            local_idx = np.arange(start, start + len(remote), dtype=np.int32)
        else:
            local_list, local_idx = self.blocks, local
        return self._agent.make_prepped_xfer("READ", local_list, local_idx, remote_list,
                                             remote_idx, b"")
