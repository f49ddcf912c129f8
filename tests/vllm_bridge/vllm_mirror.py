"""The end-to-end tests' own record of what one vLLM server holds, from its KV events, written
apart from the bridge (raw msgpack, no vllm_bridge code): the oracle the published block set is
compared with.

A thread subscribes to the server's PUB socket before any request is sent and keeps every block
vLLM reported (its parent and tokens) and which of them are still held. `own_hashes(seed)` names
the held ones in Tandem's hashes: the chain over their tokens from the seed (common/hashing.py),
as the router hashes a prompt. Any batch missed (a seq other than the next) is counted in
`gaps`: a test asserts there were none, so the oracle cannot be silently incomplete.
"""

from __future__ import annotations

import threading

from common.hashing import hash_blocks
from testing.vllm_fleet import EventTap


class VLLMEventMirror(EventTap):
    def __init__(self, endpoint: str, block_size: int) -> None:
        self.block_size = block_size
        self.gaps = 0
        self.num_stored = 0
        self.num_removed = 0
        # vLLM hash -> parent, tokens
        self._known: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self._held: set[int] = set()  # vLLM hashes
        self._next_seq = 0
        self._lock = threading.Lock()
        super().__init__(endpoint)

    def restarted(self) -> None:
        """The server was restarted: it holds nothing and counts batches from 0 again."""
        with self._lock:
            self._held.clear()
            self._next_seq = 0

    def own_hashes(self, seed: int) -> set[int]:
        """The blocks the server holds now, in Tandem's hashes."""
        with self._lock:
            held, known = set(self._held), dict(self._known)
        own: dict[int, int] = {}

        def name(h: int) -> int:
            if h not in own:
                parent, tokens = known[h]
                own[h] = hash_blocks(list(tokens), self.block_size, seed,
                                     None if parent is None else name(parent))[0]
            return own[h]

        return {name(h) for h in held}

    def on_batch(self, seq: int, payload: bytes, events: list) -> None:
        with self._lock:
            if seq != self._next_seq:
                self.gaps += 1
            self._next_seq = seq + 1
            for ev in events:
                self._apply(ev)

    def _apply(self, ev: dict) -> None:
        kind = ev["type"]
        if kind == "BlockStored":
            bs = ev["block_size"]
            assert bs == self.block_size, ev
            parent = ev["parent_block_hash"]
            for i, h in enumerate(ev["block_hashes"]):
                self._known[h] = (parent, tuple(ev["token_ids"][i * bs:(i + 1) * bs]))
                self._held.add(h)
                parent = h
            self.num_stored += len(ev["block_hashes"])
        elif kind == "BlockRemoved":
            self._held.difference_update(ev["block_hashes"])
            self.num_removed += len(ev["block_hashes"])
        elif kind == "AllBlocksCleared":
            self._held.clear()
