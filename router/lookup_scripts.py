"""The Lua scripts of the Redis-backed prefix index (router/index.py `RedisPrefixIndex`): one
call per lookup (per shard slot on a cluster). ARGV is always the prompt's block hashes in order
(`hash_member` strings).

Each device search is a function `device_run(key)`: the leading hashes present in set `key`.

- `exact` walks until the first miss, asking membership in chunks with SMISMEMBER (Redis >= 6.2):
  one call per chunk instead of one per block, the first chunk small so a worker that holds
  nothing costs one call.
- `gallop` probes blocks 1, 2, 4, 8, ... until a miss, then binary-searches the gap: O(log
  matched) lookups. It assumes a worker's blocks of one chain form a prefix, which the workers'
  eviction order keeps true (a sequence's blocks are freed tail first and evicted
  least-recently-freed first); where a middle block was evicted anyway it can overcount, which
  only misplaces a request, never corrupts one (workers compute what they lack).

`SEARCHES[search]`: KEYS = one device set per worker; returns its run per worker.
`tiered(search)`: KEYS = each worker's device, host and disk sets (common/registry.py
`block_sets`), three each; returns per worker {device, host, disk}, its leading run held in any
tier split by the fastest tier holding each block (router/tiered_match.py). A worker with no
lower tier set costs one EXISTS besides its device search; one with some is walked block by
block (whatever the search: the run is split block by block anyway).
"""

from __future__ import annotations

_EXACT = """
local function device_run(key)
  local n, start, size = 0, 1, 8
  while start <= #ARGV do
    local stop = math.min(start + size - 1, #ARGV)
    local hits = redis.call('SMISMEMBER', key, unpack(ARGV, start, stop))
    for k = 1, #hits do
      if hits[k] == 1 then n = n + 1 else return n end
    end
    start = stop + 1
    size = math.min(size * 4, 512)
  end
  return n
end
"""

_GALLOP = """
local function device_run(key)
  local n_args = #ARGV
  local lo, hi = 0, nil  -- ARGV[1..lo] held (assumed), ARGV[hi] missing
  local probe = 1
  while probe <= n_args do
    if redis.call('SISMEMBER', key, ARGV[probe]) == 1 then lo = probe; probe = probe * 2
    else hi = probe break end
  end
  if hi == nil then
    if lo < n_args then
      if redis.call('SISMEMBER', key, ARGV[n_args]) == 1 then lo = n_args else hi = n_args end
    end
  end
  if hi ~= nil then
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if redis.call('SISMEMBER', key, ARGV[mid]) == 1 then lo = mid else hi = mid end
    end
  end
  return lo
end
"""

_DEVICE_LOOP = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = device_run(key)
end
return out
"""

_TIERED_LOOP = """
local function tiered_run(dev, host, disk)
  local nd, nh, nk, start, size = 0, 0, 0, 1, 8
  while start <= #ARGV do
    local stop = math.min(start + size - 1, #ARGV)
    local d = redis.call('SMISMEMBER', dev, unpack(ARGV, start, stop))
    local h = redis.call('SMISMEMBER', host, unpack(ARGV, start, stop))
    local k = redis.call('SMISMEMBER', disk, unpack(ARGV, start, stop))
    for i = 1, #d do
      if d[i] == 1 then nd = nd + 1
      elseif h[i] == 1 then nh = nh + 1
      elseif k[i] == 1 then nk = nk + 1
      else return {nd, nh, nk} end
    end
    start = stop + 1
    size = math.min(size * 4, 512)
  end
  return {nd, nh, nk}
end

local out = {}
for w = 1, #KEYS / 3 do
  local dev, host, disk = KEYS[3 * w - 2], KEYS[3 * w - 1], KEYS[3 * w]
  if redis.call('EXISTS', host, disk) == 0 then
    out[w] = {device_run(dev), 0, 0}
  else
    out[w] = tiered_run(dev, host, disk)
  end
end
return out
"""

_DEVICE_RUNS = {"exact": _EXACT, "gallop": _GALLOP}
SEARCHES = {name: run + _DEVICE_LOOP for name, run in _DEVICE_RUNS.items()}


def tiered(search: str) -> str:
    """The tiered script whose workers without lower tiers are searched with `search`."""
    return _DEVICE_RUNS[search] + _TIERED_LOOP
