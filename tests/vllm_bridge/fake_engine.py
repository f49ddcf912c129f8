"""A fake vLLM server with an engine behind it, for the CI twin of the real-vLLM routing test
(tests/vllm_bridge/test_bridged_routing.py): the routes the bridge reads and the KV-event
publisher (tests/vllm_bridge/fake_vllm.py), plus what the router sends, `POST /v1/completions`
with a token-id prompt, answered in vLLM's SSE format as router/vllm_backend.py reads it.

Its prefix cache is vLLM's as far as routing can see: full blocks named by 64-bit hashes, each
chained over its parent's, kept in an LRU of `capacity` blocks. A request hits the leading
blocks of its prompt that the cache holds (never the last prompt token, which vLLM always
computes: `cached_tokens` is at most (len - 1) // block_size blocks); then the cache stores the
prompt's other full blocks and publishes one batch, as vLLM does after the prefill step: a
`BlockRemoved` per block evicted for room (least recently used first) and a `BlockStored` for the
new run (parent: the last block hit). A request's blocks are touched tail first, so a prefix
outlives its continuations, as in vLLM's free-block queue.

`FakeVLLM` runs it all on a thread of its own, so a test that drives real processes with
blocking calls keeps it answering. `hold()` stops streams after their first token and keeps the
events unsent until `release()`: a test can keep a request in flight, or route a second one
before the first one's event has arrived, without sleeping.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import orjson
from aiohttp import web

from tests.vllm_bridge.fake_vllm import FakePublisher, FakeServer
from vllm_bridge.encoding import encode_batch
from vllm_bridge.events import BlockRemoved, BlockStored, Event, EventBatch

WAIT_S = 10.0  # a guard against a hung call into the fake's thread, never a condition


@dataclass(frozen=True)
class Served:
    """One completion the fake answered: what it was sent, what it answered, what it hit."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    num_cached_tokens: int


class FakeKVCache:
    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size, self.capacity = block_size, capacity
        # vLLM hash -> the tokens from 0 to the block's end, least recently used first
        self.blocks: collections.OrderedDict[int, tuple[int, ...]] = collections.OrderedDict()
        self.num_evicted = 0

    def chain(self, prompt: list[int]) -> list[int]:
        """The hashes of the prompt's full blocks, each over its parent's and its tokens."""
        hashes, parent, bs = [], 0, self.block_size
        for i in range(len(prompt) // bs):
            data = parent.to_bytes(8, "big") + b"".join(t.to_bytes(4, "big")
                                                        for t in prompt[i * bs:(i + 1) * bs])
            parent = int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
            hashes.append(parent)
        return hashes

    def admit(self, prompt: list[int]) -> tuple[int, list[Event]]:
        """One request's prefill: (its cached tokens, the events it makes)."""
        bs, hashes = self.block_size, self.chain(prompt)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            hit += 1
        new = hashes[hit:self.capacity]  # a prompt over the whole cache: the router refuses it
        evicted, hits = [], set(hashes[:hit])
        for h in list(self.blocks):  # least recently used first
            if len(self.blocks) + len(new) <= self.capacity:
                break
            if h not in hits:
                del self.blocks[h]
                evicted.append(h)
        self.num_evicted += len(evicted)
        events: list[Event] = [BlockRemoved((h,), "GPU", 0) for h in evicted]
        if new:
            events.append(BlockStored(tuple(new), hashes[hit - 1] if hit else None,
                                      tuple(prompt[hit * bs:(hit + len(new)) * bs]), bs, None, 0,
                                      "GPU", None))
        for i, h in enumerate(new, hit):
            self.blocks[h] = tuple(prompt[:(i + 1) * bs])
        for h in reversed(hashes[:hit + len(new)]):  # the head ends most recently used
            self.blocks.move_to_end(h)
        return min(hit, (len(prompt) - 1) // bs) * bs, events


def answer_ids(prompt: list[int], n: int) -> tuple[int, ...]:
    """The fake's answer: `n` token ids drawn from the prompt (the same prompt, the same ids)."""
    return tuple(10 + b % 190 for b in hashlib.sha256(orjson.dumps(prompt)).digest()[:n])


class FakeVLLM:
    """One fake vLLM server (HTTP routes, KV-event publisher, prefix cache) serving the model in
    `folder` under its folder's name, on a thread of its own. The public methods are called
    from the test's thread; `served` lists every completion answered, in arrival order."""

    # What testing/vllm_fleet.py's VLLMBridge reads of a server besides its URL and folder: no
    # endpoints given (the bridge finds them at /kv_event_sources), no block size (/metrics).
    events_endpoint = replay_endpoint = None
    options = SimpleNamespace(block_size=None)

    def __init__(self, folder: Path, *, block_size: int = 4, capacity: int = 64,
                 output_len: int = 4, topic: str = "kv@fake") -> None:
        self.folder, self.topic, self.output_len = folder, topic, output_len
        self.cache = FakeKVCache(block_size, capacity)
        self.served: list[Served] = []
        self.url, self.port = "", 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"fake-vllm-{topic}")
        self._thread.start()
        self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(WAIT_S)

    async def _start(self) -> None:
        self._streams = asyncio.Event()
        self._streams.set()
        self._held_events: list[bytes] | None = None  # a list while held
        self._send_lock = asyncio.Lock()
        self.pub = FakePublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", self.topic)
        await self.pub.start()
        source = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": self.topic,
                  "buffer_steps": 10000, "endpoint": self.pub.endpoint.replace("127.0.0.1", "*"),
                  "replay_endpoint": self.pub.replay_endpoint.replace("127.0.0.1", "*")}
        self.server = FakeServer(root=str(self.folder), names=(self.folder.name,),
                                 block_size=self.cache.block_size,
                                 num_gpu_blocks=self.cache.capacity, sources={"0": source},
                                 completions=self._completions)
        self.server.running = self.server.waiting = 0  # ties go by the router's own counts
        self.url = await self.server.start()
        self.port = int(self.url.rpartition(":")[2])

    # ---- what a test does to it ----------------------------------------------------------------

    def hold(self) -> None:
        """From now on streams stop after their first token (a one-token answer is not held)
        and events are kept unsent."""
        async def go() -> None:
            self._streams.clear()
            if self._held_events is None:
                self._held_events = []
        self._call(go())

    def release(self) -> None:
        """The kept events go out (in order) and the held streams finish."""
        async def go() -> None:
            held, self._held_events = self._held_events or [], None
            for payload in held:
                await self._send(payload)
            self._streams.set()
        self._call(go())

    def restart(self) -> None:
        """A new process: seqs from 0, an empty replay buffer and cache, a new start time."""
        async def go() -> None:
            if self._held_events is not None:
                self._held_events.clear()
            await self.pub.restart()
            self.cache.blocks.clear()
            self.server.start_time += 1
        self._call(go())

    def die(self) -> None:
        """/health (and every completion) answers 503 from now on, as a vLLM whose engine died."""
        self.server.healthy = False

    def held_prefixes(self) -> list[tuple[int, ...]]:
        """Each cached block as the tokens from 0 to its end."""
        async def go() -> list[tuple[int, ...]]:
            return list(self.cache.blocks.values())
        return self._call(go())

    def close(self) -> None:
        async def go() -> None:
            self._streams.set()
            await self.server.close()
            await self.pub.close()
        try:
            self._call(go())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(WAIT_S)

    # ---- the engine ----------------------------------------------------------------------------

    async def _send(self, payload: bytes) -> None:
        async with self._send_lock:  # seqs go out in the order they are taken
            await self.pub.publish(payload)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if not self.server.healthy:
            return web.json_response({"error": {"message": "engine dead"}}, status=503)
        body = await request.json()
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
        if not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
                and type(max_tokens) is int and max_tokens > 0 and body.get("stream") is True):
            return web.json_response({"error": {"message": "unexpected request"}}, status=400)
        cached, events = self.cache.admit(prompt)
        output = answer_ids(prompt, min(self.output_len, max_tokens))
        self.served.append(Served(tuple(prompt), output, cached))
        if events:
            payload = encode_batch(EventBatch(time.time(), tuple(events), 0))
            if self._held_events is not None:
                self._held_events.append(payload)
            else:
                await self._send(payload)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": f"cmpl-{len(self.served)}", "object": "text_completion",
                "created": int(time.time()), "model": body.get("model")}
        for i, token in enumerate(output):
            if i == 1:
                await self._streams.wait()
            done = i == len(output) - 1
            reason = ("length" if len(output) == max_tokens else "stop") if done else None
            await _sse(resp, {**base, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                   "finish_reason": reason, "stop_reason": None,
                                                   "token_ids": [token]}]})
        await _sse(resp, {**base, "choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": len(output),
            "total_tokens": len(prompt) + len(output),
            "prompt_tokens_details": {"cached_tokens": cached}}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _sse(resp: web.StreamResponse, chunk: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
