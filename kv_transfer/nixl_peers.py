"""The peers a NIXL transport reads from: each one's validated parameters, its agent loaded
into ours, and descriptor lists of its cache blocks and staging slots prepared once (a pull then
names indices). Validation happens once per peer, not per pull."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from kv_transfer.descriptors import block_descriptors
from kv_transfer.layout import BlockRangeError, KVLayout
from kv_transfer.transport import PeerMetadata, TransferError

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
class NixlPeer:
    agent_name: str
    params: NixlParams
    blocks: object | None = None  # prepared descriptor list of its cache blocks
    slots: object | None = None  # and of its staging slots
    label_known: bool = False

    def check_slots(self, staged_slots, num_blocks: int) -> np.ndarray:
        """Staged slots a handle named must lie in the peer's staging region; returns them as
        an int32 array (what a prepared READ indexes with)."""
        limit = self.params.staging_num_blocks
        if len(staged_slots) != num_blocks:
            raise ValueError("staged slots and remote blocks differ in length")
        try:
            slots = np.asarray(staged_slots, dtype=np.int64)
        except (OverflowError, TypeError, ValueError) as e:
            raise BlockRangeError(f"staged slots out of the peer's range [0, {limit})") from e
        if slots.ndim != 1 or (slots.size and (slots.min() < 0 or slots.max() >= limit)):
            raise BlockRangeError(f"staged slots out of the peer's range [0, {limit})")
        return slots.astype(np.int32)


class NixlPeers:
    def __init__(self, agent, layout: KVLayout) -> None:
        self._agent = agent
        self.layout = layout
        self._peers: dict[str, NixlPeer] = {}

    def known(self, engine_id: str) -> NixlPeer | None:
        return self._peers.get(engine_id)

    def get(self, peer: PeerMetadata, prepare: bool) -> NixlPeer:
        """The peer, loaded on first use (TransferError if its metadata is bad); `prepare`:
        prepare descriptor lists of its blocks and slots (this side has its own prepared)."""
        known = self._peers.get(peer.engine_id)
        if known is not None:
            return known
        try:
            params = NixlParams.model_validate(peer.params)
        except ValidationError as e:
            raise TransferError(f"invalid NIXL metadata from {peer.engine_id}: "
                                f"{e.errors()[0]['msg']}") from e
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
        known = NixlPeer(name, params)
        self._peers[peer.engine_id] = known
        try:
            if prepare and peer.layout.num_blocks <= MAX_PREPPED_BLOCKS:
                known.blocks = self._prep(name, params.base_address, peer.layout.num_blocks, params)
                if params.staging_num_blocks and params.staging_address:
                    known.slots = self._prep(name, params.staging_address,
                                             params.staging_num_blocks, params)
        except Exception:
            self.forget(peer.engine_id)
            raise
        return known

    def _prep(self, name: str, base: int, num_blocks: int, params: NixlParams):
        return self._agent.prep_xfer_dlist(
            name, block_descriptors(self.layout, base, num_blocks, params.device_id),
            params.mem_type)

    def forget(self, engine_id: str) -> None:
        known = self._peers.pop(engine_id, None)
        if known is None:
            return
        for prepped in (known.blocks, known.slots):
            if prepped is not None:
                try:
                    self._agent.release_dlist_handle(prepped)
                except Exception:  # noqa: BLE001 - the peer may be half gone
                    pass
        self._agent.remove_remote_agent(known.agent_name)

    def clear(self) -> None:
        for engine_id in list(self._peers):
            try:
                self.forget(engine_id)
            except Exception:  # noqa: BLE001 - peer may be gone already
                pass
