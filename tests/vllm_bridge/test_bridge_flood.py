"""The real `tandem vllm-bridge` process under a hostile publisher on its events endpoint (issue
38 item 6): 16 batches of 60 MiB that look valid, junk, and valid-looking batches at every bound
the bridge applies (14.5 MiB, 2^21 token ids), sent as fast as ZMQ takes them while a healthy
fake vLLM server answers its probes. The bridge must stay small, keep the server registered and
heartbeating throughout, and still mirror an honest batch afterwards.

The bound on RSS. Before the fix the bridge queued every batch (RCVHWM 10,000 x 64 MiB) and
decoded them on the loop of its probes: 85 -> ~2,000 MiB here, and the server deregistered.
Now what it holds is bounded by its design: ZMQ's pipe (RCVHWM 1, plus the message being read:
2 x 14.5 MiB), the byte-bounded queue (--max-queued-bytes, 32 MiB), the batch being decoded
(14.5 MiB) with one event decoded at a time (2^18 token ids, ~13 MiB as Python objects), and the
chain at its size bound (max_blocks 65,536 plus one event: ~18 MiB): ~110 MiB, and
allocator slack. Measured: +86 to +108 MiB on a loaded 2-core machine. 150 MiB keeps a margin
and stays an order of magnitude below the failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from common.hashing import BlockHasher, hash_member
from common.registry import EVENT_SHARDS, RedisKeys
from testing.redis_server import REDIS_URL
from tests.vllm_bridge.fake_vllm import FakePublisher, FakeServer, stored

REPO = Path(__file__).resolve().parents[2]
ROOT = "/models/smollm2-135m-instruct"
TOPIC = "kv@vllm0@smollm2"
WID = "vllm-flood"
WAIT_S = 30.0  # a guard against hanging, never a condition
NUM_ROUNDS = 16  # rounds of the flood, each with one 60 MiB batch
ROUND_GAP_S = 0.5
SETTLE_S = 4.0  # watched after the flood too: a backlog would show here
RSS_BOUND_MIB = 150  # above the baseline; see the module docstring
POLL_S = 0.05
HEARTBEAT_TTL_S = 3  # the bridge refreshes its key every second
TOKENS = list(range(100, 112))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def valid_looking(num_events: int, first_hash: int) -> bytes:
    """A batch every check of its shape passes: `num_events` BlockStored events of block size
    4 from the root, each at events.py's bound of 65,536 blocks, with token ids of 5 bytes
    (1.8 MiB an event)."""
    per_event = 1 << 16
    tokens = [70_000 + i % 1000 for i in range(per_event * 4)]
    events = [{"type": "BlockStored", "parent_block_hash": None, "token_ids": tokens,
               "block_hashes": list(range(first_hash + i * per_event,
                                          first_hash + (i + 1) * per_event)),
               "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}
              for i in range(num_events)]
    return msgspec.msgpack.encode([1.0, events, 0])


class Watch:
    """Samples the bridge's RSS and its registration key every POLL_S."""

    def __init__(self, redis, keys: RedisKeys, pid: int) -> None:
        self.redis, self.keys, self.pid = redis, keys, pid
        self.rss: list[float] = []
        self.missing: list[float] = []  # when the registration was not there
        self.refreshes = 0  # heartbeats seen: the key's TTL went up
        self._last_pttl: int | None = None

    async def run(self) -> None:
        while True:
            self.rss.append(rss_mib(self.pid))
            pttl = await self.redis.pttl(self.keys.worker(WID))
            if pttl < 0:
                self.missing.append(time.monotonic())
            elif self._last_pttl is not None and pttl > self._last_pttl + 200:
                self.refreshes += 1
            self._last_pttl = pttl if pttl >= 0 else None
            await asyncio.sleep(POLL_S)


async def until(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := await predicate():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.redis
def test_a_hostile_publisher_neither_bloats_the_bridge_nor_deregisters_vllm(tmp_path):
    hasher = BlockHasher(hashlib.sha256(ROOT.encode()).hexdigest()[:16], 4, None)
    honest = {hash_member(h).encode() for h in hasher(TOKENS)}
    huge = valid_looking(33, 1 << 40)  # 60 MiB: over the bridge's bound, never let in whole
    under = valid_looking(8, 1 << 41)  # 14.5 MiB, 2^21 token ids: within every bound
    junk = b"\xc1" * (15 << 20)

    async def go():
        pub = FakePublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", TOPIC)
        await pub.start()
        sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "topic": TOPIC,
                         "endpoint": pub.endpoint.replace("127.0.0.1", "*"),
                         "replay_endpoint": pub.replay_endpoint.replace("127.0.0.1", "*")}}
        server = FakeServer(root=ROOT, block_size=4, num_gpu_blocks=64, sources=sources)
        url = await server.start()
        keys = RedisKeys(f"bridge-flood-{uuid.uuid4().hex[:8]}")
        redis = aioredis.from_url(REDIS_URL)
        log = open(tmp_path / "bridge.log", "wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.cli", "vllm-bridge", "--vllm-url", url,
            "--redis-url", REDIS_URL, "--namespace", keys.namespace, "--worker-id", WID,
            "--health-interval-s", "0.2", "--heartbeat-ttl-s", str(HEARTBEAT_TTL_S),
            cwd=REPO, stdout=log, stderr=log)
        watch_task = None
        try:
            await until(lambda: redis.exists(keys.worker(WID)), "the registration")
            await pub.subscribed(WAIT_S)
            await pub.publish(stored([11, 12, 13], TOKENS, ts=1.0))
            await until(lambda: _holds(redis, keys, honest), "the first honest blocks")
            await asyncio.sleep(1.0)  # settled: the baseline
            baseline = rss_mib(proc.pid)
            watch = Watch(redis, keys, proc.pid)
            watch_task = asyncio.create_task(watch.run())

            seq = 1 << 40  # the hostile publisher's own numbering
            started = time.monotonic()
            for _ in range(NUM_ROUNDS):
                for data in (under, junk, under, huge):
                    # copy=False: the same bytes every time, no copy in this process
                    await pub.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), data],
                                                 copy=False)
                    seq += 1
                await asyncio.sleep(ROUND_GAP_S)
            await asyncio.sleep(SETTLE_S)
            flood_s = time.monotonic() - started
            watch_task.cancel()
            await asyncio.gather(watch_task, return_exceptions=True)
            assert proc.returncode is None, "the bridge died"

            peak = max(watch.rss)
            assert not watch.missing, (
                f"the healthy server was deregistered for {len(watch.missing) * POLL_S:.1f} s "
                f"of {flood_s:.1f} s (peak RSS {peak:.0f} MiB, baseline {baseline:.0f})")
            assert watch.refreshes >= flood_s / (HEARTBEAT_TTL_S / 3) - 3, (
                f"{watch.refreshes} heartbeats in {flood_s:.1f} s")
            assert peak - baseline < RSS_BOUND_MIB, (
                f"RSS {baseline:.0f} -> {peak:.0f} MiB under the flood")

            # An honest batch after the flood is mirrored (through whatever resets the hostile
            # seqs caused: the honest publisher's replay buffer holds every honest batch).
            await pub.publish(stored([21, 22, 23], TOKENS[:8] + [7, 7, 7, 7], ts=2.0))
            after = {hash_member(h).encode() for h in hasher(TOKENS[:8] + [7, 7, 7, 7])}
            await until(lambda: _holds(redis, keys, after), "the honest blocks after the flood")
            print(f"flood {flood_s:.1f} s: RSS {baseline:.0f} -> peak {peak:.0f} MiB, "
                  f"{watch.refreshes} heartbeats, registered throughout")
        finally:
            if watch_task is not None:
                watch_task.cancel()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()
            leftovers = [k async for k in redis.scan_iter(f"{keys.prefix}*")]
            for shard in range(EVENT_SHARDS):
                leftovers.append(keys.events(shard))
            await redis.delete(*leftovers)
            await redis.aclose()
            await server.close()
            await pub.close()

    asyncio.run(go())


async def _holds(redis, keys: RedisKeys, members: set[bytes]) -> bool:
    return members <= await redis.smembers(keys.blocks(WID))
