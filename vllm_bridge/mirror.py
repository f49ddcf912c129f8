"""One session's KV events, from the vLLM publisher's sockets to the block set in Redis.

The EventSubscriber (vllm_bridge/subscriber.py) runs on the bridge's event loop, where it only
moves bytes: its link drains the sockets into queues bounded in bytes (vllm_bridge/link.py).
Decoding (events.py) and hashing (chain.py) run on a thread of their own, one batch at a time,
so neither a flood of batches nor one huge batch holds the loop that probes the server's health
and sends the heartbeat (issue 38 item 6: a flood deregistered a healthy server). The chain is
changed on that thread only. The publisher's snapshot (its full rewrite, which its heartbeat
waits for) reads the chain from another thread between two events, not after the whole batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from common.background import BackgroundErrors, cancelling
from common.publisher import WorkerPublisher
from vllm_bridge.chain import BlockChain
from vllm_bridge.events import BatchReader
from vllm_bridge.metrics import BridgeCounts
from vllm_bridge.settings import BridgeSettings
from vllm_bridge.subscriber import Batch, EventSubscriber, Item

R = TypeVar("R")


@dataclass
class Source:
    endpoint: str
    replay_endpoint: str | None
    topic: str


class EventMirror:
    """Feeds the subscriber's batches into `chain` and `publisher` until `stop()`."""

    def __init__(self, chain: BlockChain, publisher: WorkerPublisher, source: Source,
                 settings: BridgeSettings, tally: BridgeCounts, errors: BackgroundErrors) -> None:
        self.chain, self.publisher, self.source = chain, publisher, source
        self.settings, self.tally, self.errors = settings, tally, errors
        self.own = tally.totals["bridge"]
        self.subscriber: EventSubscriber | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-events")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="vllm-events")

    async def snapshot(self) -> dict[str, list[int]]:
        """The own hashes held per tier (the publisher's full rewrite), read between two
        events."""
        return await asyncio.to_thread(self.chain.hashes_by_medium)

    async def stop(self) -> None:
        """Stop mirroring; the chain is emptied once the batch in hand (if any) is done."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._on_thread(self.chain.clear)
        self._thread.shutdown(wait=False)

    async def _on_thread(self, fn: Callable[..., R], *args) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _run(self) -> None:
        backoff = 0.5
        st, source = self.settings, self.source
        while not cancelling():
            sub = self.subscriber = EventSubscriber(
                source.endpoint, source.replay_endpoint, source.topic,
                replay_timeout_s=st.replay_timeout_s, max_payload_bytes=st.max_payload_bytes,
                max_queued_bytes=st.max_queued_bytes)
            try:
                async with contextlib.aclosing(sub.items()) as items:  # its sockets close now
                    async for item in items:
                        await self._on_thread(self._apply, item)
                        backoff = 0.5
            except Exception as e:  # noqa: BLE001 - a socket error: a new subscriber, later
                self.own["subscriber_failures"] += 1
                self.errors.record("vllm_bridge_events", e, key="subscriber")
            finally:
                self.tally.add("events", sub.counts)
                self.subscriber = None
            # A new subscriber starts over from the publisher's oldest batch.
            await self._on_thread(self._reset)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    # ---- on the chain's thread ----------------------------------------------------------------

    def _apply(self, item: Item) -> None:
        if not isinstance(item, Batch):  # vLLM restarted, or its history is lost
            self._reset()
            return
        try:
            batch = BatchReader(item.payload)  # decoded one event at a time, as it is applied
            try:
                events = self.chain.apply(batch)
            finally:
                self.own["unknown_events"] += batch.num_unknown
        except Exception as e:  # noqa: BLE001 - a bad batch never stops the mirror
            self.own["bad_payloads"] += 1
            self.errors.record("vllm_bridge_events", f"batch {item.seq} skipped: {e}",
                               key="bad_payload")
            if len(self.chain):  # it may have removed blocks still held here: start over
                self._reset()
            return
        if events:
            self.publisher.on_events(events)  # thread-safe: the engine thread calls it too

    def _reset(self) -> None:
        self.chain.clear()
        self.publisher.resync()  # a new epoch and an empty set: every router re-reads it
