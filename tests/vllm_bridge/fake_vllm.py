"""A fake vLLM server for the bridge's tests: its KV-event publisher with vLLM 0.32's framing
(vllm/distributed/kv_events.py), and the HTTP routes the bridge reads (/health, /v1/models,
/metrics, /kv_event_sources). It runs on the test's event loop.

The publisher binds an XPUB where vLLM binds a PUB: the subscriber cannot tell them apart (same
wire), and the XPUB lets a test wait for the subscription instead of sleeping past ZMQ's slow
joiner (a PUB drops what it sends before the subscription has arrived).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

import zmq
import zmq.asyncio
from aiohttp import web

from vllm_bridge.encoding import encode_batch
from vllm_bridge.events import BlockRemoved, BlockStored, EventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class FakePublisher:
    """vLLM's publisher: `publish` sends a batch and keeps it for replay (the last
    `buffer_steps`); `restart` is a new process (seqs from 0, an empty buffer).
    `replay_topic=False`: replay answers as vLLM before 0.32 sent them, without the topic frame
    (vllm#45174)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "",
                 buffer_steps: int = 10_000, replay_topic: bool = True) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.replay_topic = replay_topic
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.seq = 0
        self.answer_replays = True
        self.num_replays = 0  # answered to the end
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.pub = self._ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self.pub, self.endpoint)
        self._tasks = [asyncio.create_task(self._watch_subscriptions())]
        if self.replay_endpoint:
            self.router = self._ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self.router, self.replay_endpoint)
            self._tasks.append(asyncio.create_task(self._serve_replays()))

    async def subscribed(self, timeout_s: float = 10.0) -> None:
        """Until a subscriber's subscription has reached this process."""
        await asyncio.wait_for(self._subscribed.wait(), timeout_s)

    async def publish(self, payload: bytes, live: bool = True) -> int:
        """Send one batch (`live=False`: kept for replay only, as if the subscriber missed it)."""
        seq, self.seq = self.seq, self.seq + 1
        if live:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.buffer.append((seq, payload))
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def restart(self) -> None:
        await self.close()
        self.seq = 0
        self.buffer.clear()
        self._subscribed = asyncio.Event()
        await self.start()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _watch_subscriptions(self) -> None:
        while True:
            frames = await self.pub.recv_multipart()
            if frames and frames[0][:1] == b"\x01":
                self._subscribed.set()

    async def _serve_replays(self) -> None:
        # vLLM's _service_replay: [identity, b"", start] in, each buffered seq >= start out, then
        # the end marker.
        topic = [self.topic] if self.replay_topic else []
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or not self.answer_replays:
                continue
            identity, _, start = frames
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([identity, b"", *topic,
                                                      seq.to_bytes(8, "big"), payload])
            end = [b""] if self.replay_topic else []
            await self.router.send_multipart([identity, b"", *end, END_SEQ, b""])
            self.num_replays += 1


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; `tcp://127.0.0.1:*` takes a free port, kept for the next start (a restart binds
    the same endpoint, as vLLM does)."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT) if endpoint.endswith(":*") else endpoint


def stored(hashes, tokens, parent=None, block_size=4, ts=0.0) -> bytes:
    """One batch with one BlockStored, as vLLM 0.32 encodes it."""
    event = BlockStored(tuple(hashes), parent, tuple(tokens), block_size, None, 0, "GPU", None)
    return encode_batch(EventBatch(ts, (event,), 0))


def removed(hashes, ts=0.0) -> bytes:
    return encode_batch(EventBatch(ts, (BlockRemoved(tuple(hashes), "GPU", 0),), 0))


class FakeServer:
    """vLLM's HTTP routes that the bridge reads; `healthy = False` makes /health answer 503.
    `completions`: a handler for `POST /v1/completions` (tests/vllm_bridge/fake_engine.py)."""

    def __init__(self, *, root: str = "/models/smollm2", names=("smollm2",), block_size: int = 4,
                 num_gpu_blocks: int = 64, sources: dict | None = None,
                 cache_config_line: str | None = None, completions=None) -> None:
        self.root, self.names = root, list(names)
        self.cache_config_line = cache_config_line  # a real server's, verbatim
        self.block_size, self.num_gpu_blocks = block_size, num_gpu_blocks
        self.sources = sources or {}
        self.healthy = True
        self.running, self.waiting = 2, 1
        self.start_time = 1_700_000_000.0
        self.api_key: str | None = None
        self.auth_seen: set[str | None] = set()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kv_event_sources", self._sources)
        if completions is not None:
            app.router.add_post("/v1/completions", completions)
        self._runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        self.auth_seen.add(request.headers.get("Authorization"))
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": n, "object": "model", "root": self.root, "parent": None,
                 "max_model_len": 2048} for n in self.names]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        name = self.names[0]
        cache = self.cache_config_line or (
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",engine="0",num_gpu_blocks="{self.num_gpu_blocks}",'
            'num_cpu_blocks="None"} 1.0')
        text = (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"{cache}\n"
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{name}"}} {self.running}.0\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{name}"}} {self.waiting}.0\n'
            "# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {self.start_time}\n")
        return web.Response(text=text, content_type="text/plain")

    async def _sources(self, request: web.Request) -> web.Response:
        return web.json_response(self.sources)
