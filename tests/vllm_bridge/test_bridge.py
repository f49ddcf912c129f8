"""The bridge end to end against a real Redis, a fake vLLM HTTP server and a fake publisher with
vLLM's framing: it registers the server as a `backend: vllm` worker, its block set in Redis is
the router's hashes of what vLLM stored, shrinks on removals, starts over in a new epoch when
vLLM restarts, leaves when /health fails and comes back when it passes. Then its settings, its
endpoint discovery and its command line."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import signal
import sys
import uuid

import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from common.hashing import BlockHasher, hash_member, member_hash
from common.registry import EVENT_SHARDS, RedisKeys, WorkerRegistration
from testing.redis_server import REDIS_URL
from tests.vllm_bridge import captures
from tests.vllm_bridge.fake_vllm import FakePublisher, FakeServer, removed, stored
from vllm_bridge.bridge import Bridge
from vllm_bridge.settings import BridgeSettings

WAIT_S = 10.0  # a guard against hanging, never a condition
ROOT = "/models/smollm2-135m-instruct"
TOKEN = "bridge-test-token"
SALT = "tenant-a"


async def until(predicate, what: str):
    """`await predicate()`'s first truthy value, polled; AssertionError after WAIT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while loop.time() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class World:
    def __init__(self, server: FakeServer, pub: FakePublisher, bridge: Bridge, redis, keys) -> None:
        self.server, self.pub, self.bridge, self.redis, self.keys = server, pub, bridge, redis, keys
        self.wid = bridge.settings.resolved_worker_id
        self.hasher = BlockHasher(hashlib.sha256(ROOT.encode()).hexdigest()[:16], 4, SALT)
        self.ts = 0.0

    async def registration(self) -> WorkerRegistration | None:
        raw = await self.redis.hgetall(self.keys.worker(self.wid))
        return WorkerRegistration.from_hash(raw, self.wid, TOKEN) if raw else None

    async def members(self) -> set[bytes]:
        return await self.redis.smembers(self.keys.blocks(self.wid))

    async def set_is(self, hashes) -> bool:
        return await self.members() == {hash_member(h).encode() for h in hashes}

    async def publish(self, payload_of) -> None:
        self.ts += 1.0
        await self.pub.publish(payload_of(self.ts))


@contextlib.asynccontextmanager
async def world(golden: bool = False, before=(), start: bool = True, **settings):
    """A fake vLLM (`golden`: the captured server's metrics, sources and topic), its publisher
    having sent `before` already, and a bridge running against them (`start`)."""
    real = captures.server()
    topic = real["topic"] if golden else "kv@vllm0@smollm2"
    pub = FakePublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic)
    await pub.start()
    for data in before:
        await pub.publish(data, live=False)
    sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "topic": topic,
                     "buffer_steps": 10000, "endpoint": "tcp://*:5557",
                     "replay_endpoint": "tcp://*:5558"}}
    if golden:
        sources = json.loads(real["kv_event_sources"]["body"])
    sources["0"]["endpoint"] = pub.endpoint.replace("127.0.0.1", "*")
    sources["0"]["replay_endpoint"] = pub.replay_endpoint.replace("127.0.0.1", "*")
    server = FakeServer(root=ROOT, names=("smollm2", "smollm2-alias"), block_size=4,
                        num_gpu_blocks=64, sources=sources,
                        cache_config_line=real["cache_config_info_line"] if golden else None)
    url = await server.start()
    keys = RedisKeys(f"bridge-{uuid.uuid4().hex[:8]}")
    bridge = Bridge(BridgeSettings(vllm_url=url, redis_url=REDIS_URL, namespace=keys.namespace,
                                   internal_token=TOKEN, hash_salt=SALT, health_interval_s=0.05,
                                   unhealthy_after=1, heartbeat_ttl_s=5, **settings))
    redis = aioredis.from_url(REDIS_URL)
    task = asyncio.create_task(bridge.run() if start else asyncio.sleep(0))
    w = World(server, pub, bridge, redis, keys)
    try:
        yield w
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        leftovers = [k async for k in redis.scan_iter(f"{keys.prefix}*")]
        if leftovers:
            await redis.delete(*leftovers)
        await redis.aclose()
        await server.close()
        await pub.close()


TOKENS = list(range(100, 112))  # three blocks of 4
MORE = list(range(200, 208))  # two more after them


@pytest.mark.redis
def test_registers_and_mirrors_the_cache_as_router_hashes():
    async def go():
        async with world() as w:
            reg = await until(w.registration, "the registration")
            assert reg.backend == "vllm" and reg.url == w.server.url and reg.role == "colocated"
            assert reg.served_model_names == ["smollm2", "smollm2-alias"] and reg.model == "smollm2"
            assert reg.model_digest == hashlib.sha256(ROOT.encode()).hexdigest()[:16]
            assert reg.block_size == 4 and reg.capacity == 64 and reg.max_model_len == 2048
            assert reg.hash_seed == w.hasher.seed and reg.started_at == w.server.start_time
            await w.pub.subscribed(WAIT_S)
            assert reg.load.running == 2 and reg.load.waiting == 1

            await w.publish(lambda ts: stored([11, 12, 13], TOKENS, ts=ts))
            await until(lambda: w.set_is(w.hasher(TOKENS)), "the stored blocks")
            await w.publish(lambda ts: stored([14, 15], MORE, parent=13, ts=ts))
            await until(lambda: w.set_is(w.hasher(TOKENS + MORE)), "the chained blocks")
            await w.publish(lambda ts: removed([15], ts=ts))
            await until(lambda: w.set_is(w.hasher(TOKENS + MORE)[:4]), "the removal")

            text = generate_latest(w.bridge.registry).decode()
            assert 'tandem_vllm_bridge_events_total{kind="batches"} 3.0' in text
            assert 'tandem_vllm_bridge_blocks_total{kind="stored"} 5.0' in text
            assert "tandem_vllm_bridge_registered 1.0" in text

    asyncio.run(go())


@pytest.mark.redis
def test_a_vllm_restart_empties_the_set_in_a_new_epoch():
    async def go():
        async with world() as w:
            epoch = await _holding_tokens(w)

            await w.pub.restart()  # seqs from 0, nothing published: its cache is empty
            await until(lambda: w.set_is([]), "the empty set")
            await until(lambda: _new_epoch(w, epoch), "a new epoch")  # at the next heartbeat
            await w.pub.subscribed(WAIT_S)
            await w.publish(lambda ts: stored([21, 22], MORE, ts=ts))
            await until(lambda: w.set_is(w.hasher(MORE)), "the new process's blocks")
            assert w.bridge.counts()["events"]["reset_restarted"] == 1

    asyncio.run(go())


@pytest.mark.redis
def test_unhealthy_vllm_is_deregistered_and_comes_back_in_a_new_epoch():
    async def go():
        async with world() as w:
            epoch = await _holding_tokens(w)

            w.server.healthy = False
            await until(lambda: _none(w.registration()), "the deregistration")
            assert await w.members() == set()
            assert w.bridge.session is None

            w.server.healthy = True
            reg = await until(w.registration, "the registration again")
            assert reg.events.split(":")[0] != epoch
            # The same process: its replay buffer gives the blocks back.
            await until(lambda: w.set_is(w.hasher(TOKENS)), "the replayed blocks")
            assert w.bridge.counts()["bridge"]["registrations"] == 2

    asyncio.run(go())


@pytest.mark.redis
def test_a_new_vllm_process_seen_by_its_start_time_re_registers():
    async def go():
        async with world() as w:
            first = await until(w.registration, "the registration")
            w.server.start_time += 100
            await until(lambda: _started(w, first.started_at + 100), "the new registration")
            assert w.bridge.counts()["bridge"]["deregistrations"] == 1

    asyncio.run(go())


@pytest.mark.redis
def test_bad_payloads_are_skipped_and_empty_what_may_be_stale():
    async def go():
        async with world() as w:
            await _holding_tokens(w)
            await w.pub.publish(b"\xc1 not msgpack")  # one lost batch may have removed blocks
            await until(lambda: w.set_is([]), "the emptied set")
            await w.publish(lambda ts: stored([21, 22], MORE, ts=ts))
            await until(lambda: w.set_is(w.hasher(MORE)), "blocks after the bad batch")
            assert w.bridge.counts()["bridge"]["bad_payloads"] == 1

    asyncio.run(go())


@pytest.mark.redis
def test_model_folder_names_the_model_as_tandem_workers_do(tiny_folder):
    from common.model_identity import model_digest

    async def go():
        async with world(model_folder=tiny_folder) as w:
            reg = await until(w.registration, "the registration")
            assert reg.model_digest == model_digest(tiny_folder)
            assert reg.tokenizer_path == str(tiny_folder) and reg.vocab_size == 320
            assert reg.hash_seed == BlockHasher(model_digest(tiny_folder), 4, SALT).seed

    asyncio.run(go())


@pytest.mark.redis
def test_golden_capture_gives_the_routers_hashes_of_the_captured_prompts():
    """The real server's batches (r1, its follow-up r2, a full report, a 2000-token prompt that
    evicts) reach a bridge that starts late (replayed), then a prefix-cache reset arrives live."""
    golden = captures.payloads()

    async def go():
        async with world(golden=True, before=golden[:6]) as w:
            reg = await until(w.registration, "the registration")
            assert reg.block_size == captures.BLOCK_SIZE == 32 and reg.capacity == 68
            hasher = BlockHasher(reg.model_digest, 32, SALT)
            assert reg.hash_seed == hasher.seed
            r2, r4 = hasher(captures.computed_ids("r2")), hasher(captures.computed_ids("r4"))
            await until(lambda: w.set_is(r2[:4] + r4[:62]), "the captured cache")
            # what a router hashes for the prompts it sent is there
            held = {member_hash(m) for m in await w.members()}
            assert set(hasher(captures.prompt_ids("r2"))) <= held
            assert set(hasher(captures.prompt_ids("r4"))) <= held
            await w.pub.subscribed(WAIT_S)
            await w.pub.publish(golden[6])  # AllBlocksCleared
            await until(lambda: w.set_is([]), "the cleared set")
            assert w.bridge.counts()["events"]["batches"] == 7

    asyncio.run(go())


@pytest.mark.redis
def test_the_command_registers_and_leaves_on_sigterm():
    """`tandem vllm-bridge` as a user runs it: registered once vLLM is healthy; SIGTERM deletes
    the registration and the block set on the way out, and the process exits 0."""
    async def go():
        async with world(start=False) as w:
            keys = RedisKeys(f"bridge-cli-{uuid.uuid4().hex[:8]}")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tandem.cli", "vllm-bridge", "--vllm-url", w.server.url,
                "--redis-url", REDIS_URL, "--namespace", keys.namespace, "--health-interval-s",
                "0.1", "--worker-id", "vllm-cli")
            try:
                raw = await until(lambda: w.redis.hgetall(keys.worker("vllm-cli")),
                                  "the command's registration")
                assert WorkerRegistration.from_hash(raw, "vllm-cli").backend == "vllm"
                await w.pub.subscribed(WAIT_S)
                await w.publish(lambda ts: stored([11, 12, 13], TOKENS, ts=ts))
                await until(lambda: w.redis.scard(keys.blocks("vllm-cli")), "its blocks")
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0
                assert not await w.redis.exists(keys.worker("vllm-cli"), keys.blocks("vllm-cli"))
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                for shard in range(EVENT_SHARDS):
                    await w.redis.delete(keys.events(shard))

    asyncio.run(go())


@pytest.mark.redis
def test_the_command_registers_a_multimodal_folders_text_vocabulary(tiny_folder, tmp_path):
    """A folder whose config.json has its vocabulary under `text_config` (Llava, Gemma 3, ...):
    `tandem vllm-bridge --model-folder` registers that size, as the router reads it (the
    bridge's own reader once looked at the top level only and registered none)."""
    import shutil

    folder = tmp_path / "multimodal"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"] = {"vocab_size": config.pop("vocab_size")}
    (folder / "config.json").write_text(json.dumps(config))

    async def go():
        async with world(start=False) as w:
            keys = RedisKeys(f"bridge-mm-{uuid.uuid4().hex[:8]}")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tandem.cli", "vllm-bridge", "--vllm-url", w.server.url,
                "--redis-url", REDIS_URL, "--namespace", keys.namespace, "--health-interval-s",
                "0.1", "--worker-id", "vllm-mm", "--model-folder", str(folder))
            try:
                raw = await until(lambda: w.redis.hgetall(keys.worker("vllm-mm")),
                                  "the command's registration")
                reg = WorkerRegistration.from_hash(raw, "vllm-mm")
                assert reg.tokenizer_path == str(folder) and reg.vocab_size == 320
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        await asyncio.wait_for(proc.wait(), WAIT_S)
                    except TimeoutError:
                        proc.kill()
                        await proc.wait()
                leftovers = [k async for k in w.redis.scan_iter(f"{keys.prefix}*")]
                if leftovers:
                    await w.redis.delete(*leftovers)

    asyncio.run(go())


async def _holding_tokens(w: World) -> str:
    """Registered, subscribed and holding TOKENS' three blocks; returns the set's epoch."""
    await until(w.registration, "the registration")
    await w.pub.subscribed(WAIT_S)
    await w.publish(lambda ts: stored([11, 12, 13], TOKENS, ts=ts))
    await until(lambda: w.set_is(w.hasher(TOKENS)), "the stored blocks")
    return (await w.registration()).events.split(":")[0]


async def _new_epoch(w: World, epoch: str) -> bool:
    reg = await w.registration()
    return reg is not None and reg.events.split(":")[0] != epoch


async def _none(coro) -> bool:
    return await coro is None


async def _started(w: World, started_at: float) -> bool:
    reg = await w.registration()
    return reg is not None and reg.started_at == started_at


# ---- settings and discovery --------------------------------------------------------------------


def test_settings_defaults_and_bounds():
    s = BridgeSettings(vllm_url="http://10.0.0.7:8000")
    assert s.resolved_worker_id == "vllm-10.0.0.7-8000" and s.public_url == "http://10.0.0.7:8000"
    s = BridgeSettings(vllm_url="http://127.0.0.1:8000", advertise_url="http://pod-a:8000")
    assert s.resolved_worker_id == "vllm-pod-a-8000" and s.public_url == "http://pod-a:8000"
    assert s.resolve_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert s.resolve_endpoint("tcp://10.0.0.7:5557") == "tcp://10.0.0.7:5557"
    assert s.resolve_endpoint("ipc:///tmp/kv") == "ipc:///tmp/kv"
    for bad in ({"vllm_url": "http://h:1/v1"}, {"vllm_url": "h:1"},
                {"vllm_url": "http://h:1", "events_endpoint": "udp://h:1"},
                {"vllm_url": "http://h:1", "worker_id": "a{b}"},
                {"vllm_url": "http://h:1", "health_interval_s": 0},
                {"vllm_url": "http://h:1", "block_size": 0}):
        with pytest.raises(ValueError):
            BridgeSettings(**bad)
    with pytest.raises(ValueError):
        BridgeSettings()  # --vllm-url is required


def test_discovery_refuses_what_it_cannot_subscribe_to():
    async def go():
        server = FakeServer()
        url = await server.start()
        bridge = Bridge(BridgeSettings(vllm_url=url))
        await bridge.server.start()
        try:
            with pytest.raises(ValueError, match="publishes no KV events"):
                await bridge._source()
            server.sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": "tcp://127.0.0.1:5557"}}
            with pytest.raises(ValueError, match="connects to"):
                await bridge._source()
            server.sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                                    "topic": "kv"}}
            source = await bridge._source()
            assert (source.endpoint, source.replay_endpoint, source.topic) == (
                "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv")
        finally:
            await bridge.server.close()
            await server.close()

    asyncio.run(go())


def test_command_line(monkeypatch):
    from tandem.cli import build_parser
    from tandem.settings import bridge_settings

    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN", "from-env")
    args = build_parser().parse_args(["vllm-bridge", "--vllm-url", "http://127.0.0.1:8000",
                                      "--events-endpoint", "ipc:///tmp/kv", "--block-size", "16",
                                      "--role", "decode", "-v"])
    s = bridge_settings(args)
    assert (s.events_endpoint, s.block_size, s.role, s.internal_token) == (
        "ipc:///tmp/kv", 16, "decode", "from-env")
    assert args.func.__name__ == "cmd_vllm_bridge" and args.verbose
