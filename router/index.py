"""The prefix index: per live worker, how many leading blocks of a prompt it already holds.

`RedisPrefixIndex` answers with one Lua round trip over the sets workers publish
(common/registry.py); `MemoryPrefixIndex` has the same interface for single-router development
and learns only from the router's own decisions. Backends are listed in `INDEXES`.
"""

from __future__ import annotations

from typing import Protocol

from common.hashing import hash_member
from common.registry import RedisKeys

# KEYS = blocks:{id} per candidate worker; ARGV = the prompt's block hashes in order.
# Returns, per worker, the number of leading hashes present, stopping at the first miss.
_LEADING_MATCH_LUA = """
local out = {}
for i, key in ipairs(KEYS) do
  local n = 0
  for j = 1, #ARGV do
    if redis.call('SISMEMBER', key, ARGV[j]) == 1 then n = j else break end
  end
  out[i] = n
end
return out
"""


class PrefixIndex(Protocol):
    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        """Leading matched blocks per worker id (0 for unknown workers)."""

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        """The router routed these blocks to `worker_id` (used by approximate backends)."""


class RedisPrefixIndex:
    def __init__(self, redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys
        self._script = redis.register_script(_LEADING_MATCH_LUA)

    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        if not block_hashes or not worker_ids:
            return dict.fromkeys(worker_ids, 0)
        counts = await self._script(keys=[self.keys.blocks(w) for w in worker_ids],
                                    args=[hash_member(h) for h in block_hashes])
        return {w: int(c) for w, c in zip(worker_ids, counts, strict=True)}

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        pass  # workers publish what they really hold


class MemoryPrefixIndex:
    def __init__(self, redis=None, keys: RedisKeys | None = None, max_blocks: int = 1_000_000) -> None:
        self._sets: dict[str, dict[int, None]] = {}
        self.max_blocks = max_blocks

    async def match(self, block_hashes: list[int], worker_ids: list[str]) -> dict[str, int]:
        out = {}
        for w in worker_ids:
            held = self._sets.get(w, {})
            n = 0
            for h in block_hashes:
                if h not in held:
                    break
                n += 1
            out[w] = n
        return out

    def record(self, worker_id: str, block_hashes: list[int]) -> None:
        held = self._sets.setdefault(worker_id, {})
        for h in block_hashes:
            held.pop(h, None)
            held[h] = None  # most recent last
        while len(held) > self.max_blocks:
            held.pop(next(iter(held)))

    def forget(self, worker_id: str) -> None:
        self._sets.pop(worker_id, None)


INDEXES = {"redis": RedisPrefixIndex, "memory": MemoryPrefixIndex}
