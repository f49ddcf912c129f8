"""One vLLM worker's prefix cache expressed in Tandem's block hashes (common/hashing.py).

vLLM names blocks by its own hashes (sha256 over pickle, the low 64 bits on the wire), which the
router cannot compute. Every BlockStored carries its blocks' token ids and its parent's vLLM hash,
so the chain is rebuilt here: own = hasher(token_ids, parent_hash=own[parent]), and vLLM hash ->
own hash is kept until the block is removed. The router then finds vLLM workers' blocks by the
same hashes as Tandem workers'.

Blocks that cannot be named correctly are left out and counted (`counts`), never guessed:

    unknown_parent  the parent was never seen (joined late, a lost batch); their children name
                    them as parent later, so they drop too. A full report heals it.
    extra_keys      a block keyed by more than its tokens (LoRA, multimodal, cache_salt) and every
                    block after it in the event: the router hashes plain tokens, so indexing
                    them would be false hits
    block_size      the event's block size is not the hasher's
    other_group     a KV cache group other than 0, a medium other than the GPU (None: unstated),
                    or a cache spec other than full attention
    masked          the event skipped blocks vLLM nulled or masked (sliding window): the tokens
                    of the named blocks cannot be told apart
    overflow        more than `max_blocks` mapped: everything cleared, memory stays bounded

`stored`, `removed` and `cleared` count what `apply` returned (own hashes, and clears).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from common.block_events import BlockEvent
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
              "other_group", "masked", "overflow")
_MEDIA = (None, "GPU")  # vLLM's CPU build labels its blocks "GPU" too
_FULL_ATTENTION = (None, "full_attention")


class BlockChain:
    """vLLM hash -> own hash for one worker (one data-parallel rank). One thread applies and
    clears; `hashes()` may be called from another (it reads between two events)."""

    def __init__(self, hasher: BlockHasher, max_blocks: int = 1 << 22) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.hasher = hasher
        self.max_blocks = max_blocks
        self.counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        self._own: dict[VLLMHash, int] = {}  # vLLM hash -> own hash
        self._refs: dict[int, int] = {}  # own hash -> how many vLLM hashes map to it
        self._out: list[tuple[str, list[int]]] = []
        self._lock = threading.Lock()  # held for one event at a time

    def clear(self) -> None:
        """Forget everything (vLLM restarted, or its history was lost); emits nothing."""
        with self._lock:
            self._own.clear()
            self._refs.clear()

    def hashes(self) -> list[int]:
        """The own hashes held: the worker's block set, for a full rewrite. Taken during a
        batch, the set plus that batch's events (published after it) is still the right one:
        each event, applied again, changes nothing."""
        with self._lock:
            return list(self._refs)

    def __len__(self) -> int:
        return len(self._own)

    def apply(self, batch: EventBatch | Iterable[Event]) -> list[BlockEvent]:
        """Fold one batch in (its events, or an iterable that decodes them one at a time:
        events.BatchReader); what changed in the own-hash set, in order, to publish. Adjacent
        events of one kind are merged (vLLM 0.32 sends one BlockRemoved per block)."""
        self._out = []
        for event in batch.events if isinstance(batch, EventBatch) else batch:
            with self._lock:
                if isinstance(event, BlockStored):
                    self._store(event)
                elif isinstance(event, BlockRemoved):
                    self._remove(event)
                elif isinstance(event, AllBlocksCleared):
                    self._clear_all()
                if len(self._own) > self.max_blocks:
                    self.counts["overflow"] += 1
                    self._clear_all()
            del event  # not held while the next one decodes
        out = [BlockEvent(kind, tuple(hashes)) for kind, hashes in self._out]  # type: ignore[arg-type]
        self._out = []
        return out

    def _store(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if ev.block_size != self.hasher.block_size:
            self.counts["block_size"] += n
            return
        if (ev.group_idx != 0 or ev.medium not in _MEDIA
                or ev.kv_cache_spec_kind not in _FULL_ATTENTION):
            self.counts["other_group"] += n
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
        if ev.group_idx != 0 or ev.medium not in _MEDIA:
            self.counts["other_group"] += len(ev.block_hashes)
            return
        for vllm_hash in ev.block_hashes:
            own_hash = self._own.pop(vllm_hash, None)
            if own_hash is not None:  # blocks never mapped were never published
                self._release(own_hash)

    def _release(self, own_hash: int) -> None:
        refs = self._refs[own_hash] - 1
        if refs:
            self._refs[own_hash] = refs
        else:
            del self._refs[own_hash]
            self._emit("removed", own_hash)

    def _clear_all(self) -> None:
        self._own.clear()
        self._refs.clear()
        self._out = [("cleared", [])]  # what came before in this batch no longer matters
        self.counts["cleared"] += 1

    def _emit(self, kind: str, own_hash: int) -> None:
        self.counts[kind] += 1
        if self._out and self._out[-1][0] == kind:
            self._out[-1][1].append(own_hash)
        else:
            self._out.append((kind, [own_hash]))
