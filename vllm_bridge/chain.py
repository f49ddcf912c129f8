"""One vLLM worker's prefix cache expressed in Tandem's block hashes (common/hashing.py).

vLLM names blocks by its own hashes (sha256 over pickle, the low 64 bits on the wire), which the
router cannot compute. Every BlockStored carries its blocks' token ids and its parent's vLLM hash,
so the chain is rebuilt here: own = hasher(token_ids, parent_hash=own[parent]), and vLLM hash ->
own hash is kept until the block is removed. The router then finds vLLM workers' blocks by the
same hashes as Tandem workers'.

vLLM's KV offloading (its OffloadingConnector: vllm/v1/kv_offload/) reports the blocks it copies
to CPU memory or disk as BlockStored / BlockRemoved on medium "CPU" or "Disk" (vLLM's
`LoadStoreSpec.medium()`), with the GPU block's vLLM hash and no tokens. Those are indexed in
Tandem's tiers (`TIERS`: CPU -> host, Disk -> disk), named by the own hash the GPU block got: a
block offloaded, then evicted from the GPU, stays held on the host. Those events may carry raw
digests where the GPU's carry their low 64 bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), so a
digest is also looked up by that integer.

Blocks that cannot be named correctly are left out and counted (`counts`), never guessed:

    unknown_parent  the parent was never seen (joined late, a lost batch); their children name
                    them as parent later, so they drop too. A full report heals it.
    extra_keys      a block keyed by more than its tokens (LoRA, multimodal, cache_salt) and every
                    block after it in the event: the router hashes plain tokens, so indexing
                    them would be false hits
    block_size      the event's block size is not the hasher's
    other_group     a KV cache group other than 0, or a cache spec other than full attention
    other_medium    a medium that is none of the GPU (None: unstated), CPU or Disk
    unknown_block   a block reported on a lower tier whose GPU report was never seen (joined
                    late), or an offloaded block larger than a GPU block (vLLM's offloading
                    `block_size` set above the GPU's: one hash names several blocks)
    masked          the event skipped blocks vLLM nulled or masked (sliding window): the tokens
                    of the named blocks cannot be told apart
    overflow        more than `max_blocks` mapped: everything cleared, memory stays bounded

`stored`, `removed` and `cleared` count what `apply` returned (own hashes in any tier, and
clears). vLLM's AllBlocksCleared is its GPU pool's reset: the lower tiers are kept (published as
`cleared`, which empties every tier, then every lower tier's blocks stored again).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from common.block_events import BlockEvent, Medium
from common.hashing import BlockHasher
from vllm_bridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    VLLMHash,
)

COUNT_KEYS = ("stored", "removed", "cleared", "unknown_parent", "extra_keys", "block_size",
              "other_group", "other_medium", "unknown_block", "masked", "overflow")
_MEDIA = (None, "GPU")  # vLLM's CPU build labels its blocks "GPU" too
TIERS: dict[str, Medium] = {"CPU": "host", "DISK": "disk"}  # vLLM medium (upper-cased) -> tier
_FULL_ATTENTION = (None, "full_attention")
_MASK = (1 << 64) - 1


class BlockChain:
    """vLLM hash -> own hash for one worker (one data-parallel rank). One thread applies and
    clears; `hashes()` and `hashes_by_medium()` may be called from another (they read between
    two events)."""

    def __init__(self, hasher: BlockHasher, max_blocks: int = 1 << 22) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.hasher = hasher
        self.max_blocks = max_blocks
        self.counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        self._own: dict[VLLMHash, int] = {}  # vLLM hash -> own hash (on the GPU)
        self._refs: dict[int, int] = {}  # own hash -> how many vLLM hashes map to it
        # The same per lower tier, keyed by the vLLM hash as that tier's events name it.
        self._tier_own: dict[str, dict[VLLMHash, int]] = {t: {} for t in TIERS.values()}
        self._tier_refs: dict[str, dict[int, int]] = {t: {} for t in TIERS.values()}
        self._out: list[tuple[str, str, list[int]]] = []  # (kind, medium, own hashes)
        self._lock = threading.Lock()  # held for one event at a time

    def clear(self) -> None:
        """Forget everything (vLLM restarted, or its history was lost); emits nothing."""
        with self._lock:
            self._forget_all()

    def _forget_all(self) -> None:
        for mapping in (self._own, self._refs, *self._tier_own.values(),
                        *self._tier_refs.values()):
            mapping.clear()

    def hashes(self) -> list[int]:
        """The own hashes held on the GPU (the device set)."""
        with self._lock:
            return list(self._refs)

    def hashes_by_medium(self) -> dict[str, list[int]]:
        """The own hashes held per tier: the worker's block sets, for a full rewrite. Taken
        during a batch, the sets plus that batch's events (published after it) are still the
        right ones: each event, applied again, changes nothing."""
        with self._lock:
            return {"device": list(self._refs),
                    **{tier: list(refs) for tier, refs in self._tier_refs.items()}}

    @property
    def num_device_blocks(self) -> int:
        """vLLM blocks mapped on the GPU (read from any thread: one `len`)."""
        return len(self._own)

    def __len__(self) -> int:
        """vLLM blocks mapped, in every tier."""
        return len(self._own) + sum(map(len, self._tier_own.values()))

    def apply(self, batch: EventBatch | Iterable[Event]) -> list[BlockEvent]:
        """Fold one batch in (its events, or an iterable that decodes them one at a time:
        events.BatchReader); what changed in the own-hash set, in order, to publish. Adjacent
        events of one kind are merged (vLLM 0.32 sends one BlockRemoved per block)."""
        self._out = []
        for event in batch.events if isinstance(batch, EventBatch) else batch:
            with self._lock:
                if isinstance(event, AllBlocksCleared):
                    self._clear_device()
                elif (tier := self._tier(event)) is None:
                    pass  # counted
                elif tier != "device" and isinstance(event, BlockStored):
                    self._store_tier(event, tier)
                elif tier != "device":
                    self._remove_tier(event, tier)
                elif isinstance(event, BlockStored):
                    self._store(event)
                else:
                    self._remove(event)
                if len(self) > self.max_blocks:
                    self.counts["overflow"] += 1
                    self._forget_all()
                    self._out = [("cleared", "device", [])]
                    self.counts["cleared"] += 1
            del event  # not held while the next one decodes
        out = [BlockEvent(kind, tuple(hashes), medium)  # type: ignore[arg-type]
               for kind, medium, hashes in self._out]
        self._out = []
        return out

    def _tier(self, ev: BlockStored | BlockRemoved) -> str | None:
        """The tier `ev` is about, or None (counted) if it is none of ours."""
        if ev.group_idx != 0 or (isinstance(ev, BlockStored)
                                 and ev.kv_cache_spec_kind not in _FULL_ATTENTION):
            self.counts["other_group"] += len(ev.block_hashes)
            return None
        if ev.medium in _MEDIA:
            return "device"
        tier = TIERS.get(ev.medium.upper()) if ev.medium is not None else None
        if tier is None:
            self.counts["other_medium"] += len(ev.block_hashes)
        return tier

    def _store(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if ev.block_size != self.hasher.block_size:
            self.counts["block_size"] += n
            return
        if len(ev.token_ids) != n * ev.block_size:
            self.counts["masked"] += n
            return
        if ev.parent_block_hash is None:
            parent = None
        elif (parent := self._own.get(ev.parent_block_hash)) is None:
            self.counts["unknown_parent"] += n
            return
        keep = n
        if ev.lora_name is not None or ev.lora_id is not None:
            keep = 0  # releases before extra_keys marked LoRA blocks only here
        elif ev.extra_keys is not None:
            keep = next((i for i, k in enumerate(ev.extra_keys) if k is not None), n)
        self.counts["extra_keys"] += n - keep
        if keep == 0:
            return
        tokens = ev.token_ids if keep == n else ev.token_ids[: keep * ev.block_size]
        own = self.hasher(list(tokens), parent_hash=parent)
        for vllm_hash, own_hash in zip(ev.block_hashes[:keep], own, strict=True):
            old = self._own.get(vllm_hash)
            if old == own_hash:
                continue  # re-stored (a full report): already held
            if old is not None:
                self._release(old)  # 64-bit vLLM hashes collided, or content changed
            self._own[vllm_hash] = own_hash
            refs = self._refs.get(own_hash, 0)
            self._refs[own_hash] = refs + 1
            if refs == 0:
                self._emit("stored", own_hash)

    def _remove(self, ev: BlockRemoved) -> None:
        for vllm_hash in ev.block_hashes:
            own_hash = self._own.pop(vllm_hash, None)
            if own_hash is not None:  # blocks never mapped were never published
                self._release(own_hash)

    def _store_tier(self, ev: BlockStored, tier: str) -> None:
        """Blocks copied to a lower tier: named by the own hash their GPU block got (or the one
        another tier holds them under: moved from CPU to disk)."""
        if ev.block_size not in (0, self.hasher.block_size):  # 0: newer vLLM leaves it out
            self.counts["unknown_block"] += len(ev.block_hashes)
            return
        own_map, refs = self._tier_own[tier], self._tier_refs[tier]
        for vllm_hash in ev.block_hashes:
            own_hash = self._own_hash(vllm_hash)
            if own_hash is None:
                self.counts["unknown_block"] += 1
                continue
            old = own_map.get(vllm_hash)
            if old == own_hash:
                continue
            if old is not None:
                self._release(old, tier)
            own_map[vllm_hash] = own_hash
            n = refs.get(own_hash, 0)
            refs[own_hash] = n + 1
            if n == 0:
                self._emit("stored", own_hash, tier)

    def _remove_tier(self, ev: BlockRemoved, tier: str) -> None:
        for vllm_hash in ev.block_hashes:
            own_hash = self._tier_own[tier].pop(vllm_hash, None)
            if own_hash is not None:
                self._release(own_hash, tier)

    def _own_hash(self, vllm_hash: VLLMHash) -> int | None:
        keys: tuple[VLLMHash, ...] = (vllm_hash,)
        if isinstance(vllm_hash, bytes):  # a raw digest where the GPU's events sent an int
            keys += (int.from_bytes(vllm_hash, "big") & _MASK,)
        for key in keys:
            for mapping in (self._own, *self._tier_own.values()):
                own_hash = mapping.get(key)
                if own_hash is not None:
                    return own_hash
        return None

    def _release(self, own_hash: int, medium: str = "device") -> None:
        refs_of = self._refs if medium == "device" else self._tier_refs[medium]
        refs = refs_of[own_hash] - 1
        if refs:
            refs_of[own_hash] = refs
        else:
            del refs_of[own_hash]
            self._emit("removed", own_hash, medium)

    def _clear_device(self) -> None:
        """vLLM's GPU pool was reset: published as `cleared` (every tier), the lower tiers'
        blocks stored again after it."""
        self._own.clear()
        self._refs.clear()
        self._out = [("cleared", "device", [])]  # what came before in this batch no longer counts
        self.counts["cleared"] += 1
        for tier, refs in self._tier_refs.items():
            if refs:
                self._out.append(("stored", tier, list(refs)))

    def _emit(self, kind: str, own_hash: int, medium: str = "device") -> None:
        self.counts[kind] += 1
        if self._out and self._out[-1][:2] == (kind, medium):
            self._out[-1][2].append(own_hash)
        else:
            self._out.append((kind, medium, [own_hash]))
