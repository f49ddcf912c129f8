"""The ZMQ sockets to one vLLM KV-event publisher (vllm/distributed/kv_events.py, 0.32): a SUB
for live batches, with a monitor that reports when it reconnects, and a DEALER to the replay
ROUTER. The wire:

    PUB     [topic, seq (8 bytes big-endian), payload]        one message per engine step
    ROUTER  asked    [b"", start seq (8 B BE)]                 (from a DEALER)
            answers  [b"", topic, seq, payload]                every buffered seq >= start, then
                     [b"", b"", -1 (8 B signed), b""]          the end marker

Releases before 0.32 (the fix of vllm#45174; e.g. v0.11, the chart's default image) answer
replays without the topic frame: `[b"", seq, payload]`, then `[b"", -1, b""]`. The frame count
tells the two apart; both are accepted.

Every message is validated here (frame count, an 8-byte seq, the topic, a bounded non-empty
payload); one that fails is counted in `counts["malformed"]` and skipped, never fatal. What the
seqs mean is vllm_bridge/subscriber.py's.

What a peer can make the bridge hold is bounded in bytes (issue 38 item 6: a hostile publisher
once made it queue RCVHWM 10,000 x MAXMSGSIZE 64 MiB). Each socket lets ZMQ queue `RCVHWM`
messages at most, each frame under `max_payload_bytes` + 1 KiB (a larger frame makes ZMQ drop
the connection; the link connects anew). Tasks drain the sockets at once into `ByteQueue`s that
share one budget of `max_queued_bytes` (vllm_bridge/byte_queue.py). A batch that does not fit
is dropped and counted in `counts["dropped"]`: a gap like any other, replayed by the subscriber.
One limit remains ZMQ's: it takes a message's frames until the last one, however many.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vllm_bridge.byte_queue import ByteBudget, ByteQueue

END_SEQ = b"\xff" * 8  # -1 as 8 signed bytes: the replay's end marker
MAX_SEQ = 1 << 62  # vLLM's seq is an itertools.count(); beyond this it is not vLLM's
MAX_TOPIC_BYTES = 1024
# Messages ZMQ queues per socket before it stops reading it (TCP then pushes back and vLLM's PUB
# drops, a gap): the drain tasks empty it at once, so the queues that count are in bytes.
RCVHWM = 1
# After a disconnection ZMQ does not recover from by itself (link.py `_reconnect_later`); doubled
# each time, back to the first once a valid batch arrives.
RECONNECT_DELAY_S = 0.5
MAX_RECONNECT_DELAY_S = 5.0
# Markers in the queues, between the batches
RECONNECTED, END, TIMEOUT = "reconnected", "end", "timeout"

Message = tuple[int, memoryview]  # (seq, payload): bytes-like, as ZMQ received them


class ReplayTimeout(Exception):
    pass


class PublisherLink:
    """Connected by `open()`, closed by `close()`; `counts` is the subscriber's, shared."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes,
                 counts: dict[str, int], *, replay_timeout_s: float, max_payload_bytes: int,
                 max_queued_bytes: int, max_replayed: int) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.counts = counts
        self.replay_timeout_s = replay_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.max_replayed = max_replayed  # batches one replay answer may hold
        # Live batches (queued during a replay, or while a batch is decoded) and replay answers
        # hold this many bytes together at most (payloads, and ITEM_OVERHEAD_BYTES each).
        self.budget = ByteBudget(max_queued_bytes)
        self._live: ByteQueue[Message | str | Exception] = ByteQueue(self.budget)
        self._answer: ByteQueue[Message | str | Exception] | None = None
        self._tasks: dict[str, asyncio.Task] = {}  # "live", "answer": the drains
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._poller: zmq.asyncio.Poller | None = None
        self._disconnected = False
        self._reconnect_delay_s = RECONNECT_DELAY_S
        self._reconnect_at: asyncio.TimerHandle | None = None

    def open(self) -> None:
        """Connect, and drain the SUB socket from now on (call it on the event loop)."""
        self._ctx = zmq.asyncio.Context()
        self._sub = self._socket(zmq.SUB, self.endpoint, {zmq.SUBSCRIBE: self.topic})
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        if self.replay_endpoint:
            self.new_dealer()
        self._tasks["live"] = asyncio.get_running_loop().create_task(self._drain_live())

    def _socket(self, kind: int, endpoint: str, options: dict | None = None) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        # Before connecting: HWMs apply to new pipes.
        for option, value in {zmq.RCVHWM: RCVHWM, **(options or {})}.items():
            sock.setsockopt(option, value)
        sock.setsockopt(zmq.LINGER, 0)
        # A peer that sends a frame over a payload's bound is cut off before ZMQ allocates it
        # (a protocol error: ZMQ does not reconnect, `_reconnect_later` does).
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_payload_bytes + MAX_TOPIC_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    def new_dealer(self) -> None:
        """A fresh DEALER: what an abandoned or late replay answer still sends is never read."""
        self._end_answer()
        if self._dealer is not None:
            self._dealer.close(linger=0)
        assert self.replay_endpoint is not None
        self._dealer = self._socket(zmq.DEALER, self.replay_endpoint)

    def _end_answer(self) -> None:
        task = self._tasks.pop("answer", None)
        if task is not None:
            task.cancel()
        if self._answer is not None:
            self._answer.clear()
            self._answer = None

    def close(self) -> None:
        if self._ctx is None:
            return
        self._end_answer()
        live = self._tasks.pop("live", None)
        if live is not None:
            live.cancel()
        if self._reconnect_at is not None:
            self._reconnect_at.cancel()
        self._live.clear()
        if self._sub is not None:
            self._sub.disable_monitor()
        for sock in (self._monitor, self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        self._ctx = None

    async def receive(self) -> Message | None:
        """The next valid live batch, or None when the SUB socket has just reconnected."""
        item = await self._live.get()
        if isinstance(item, Exception):
            raise item  # the drain failed (a socket error): this link is done
        return None if item == RECONNECTED else item  # type: ignore[return-value]

    async def _drain_live(self) -> None:
        """Move what the SUB socket receives into the byte-bounded queue, at once."""
        assert self._sub is not None and self._monitor is not None and self._poller is not None
        try:
            while True:
                ready = dict(await self._poller.poll())
                if self._monitor in ready:
                    event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self._disconnected = True
                        self._reconnect_later()
                    elif event == zmq.EVENT_CONNECTED and self._disconnected:
                        self._disconnected = False
                        if self._live.last() != RECONNECTED:  # one says it all
                            self._live.put_marker(RECONNECTED)
                if self._sub in ready:
                    message = self._parse(_buffers(await self._sub.recv_multipart(copy=False)))
                    if message is not None:
                        self._reconnect_delay_s = RECONNECT_DELAY_S
                    self._queue(self._live, message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, who ends the link
            self._live.put_marker(e)

    def _reconnect_later(self) -> None:
        """ZMQ reconnects by itself after a lost connection, but never after a protocol error,
        such as a frame over MAXMSGSIZE: one such frame would end the subscription for good. So
        a connection still down after a while is connected anew, whichever it was."""
        if self._reconnect_at is not None:
            self._reconnect_at.cancel()
        loop = asyncio.get_running_loop()
        self._reconnect_at = loop.call_later(self._reconnect_delay_s, self._reconnect)
        self._reconnect_delay_s = min(self._reconnect_delay_s * 2, MAX_RECONNECT_DELAY_S)

    def _reconnect(self) -> None:
        if self._sub is None or self._sub.closed or not self._disconnected:
            return
        with contextlib.suppress(zmq.ZMQError):  # already gone after a protocol error
            self._sub.disconnect(self.endpoint)
        try:
            self._sub.connect(self.endpoint)
        except zmq.ZMQError as e:  # the reader ends the link; the bridge makes a new one
            self._live.put_marker(e)

    def _queue(self, queue: ByteQueue, message: Message | None) -> None:
        if message is not None and not queue.put(message, len(message[1])):
            self.counts["dropped"] += 1  # a gap: the subscriber replays it or resets

    async def replay(self, start: int) -> AsyncIterator[Message]:
        """The valid batches of one replay answer from `start`, up to its end marker; raises
        ReplayTimeout when the replay socket stays silent longer than `replay_timeout_s`."""
        assert self._dealer is not None
        self._end_answer()
        await self._dealer.send_multipart([b"", start.to_bytes(8, "big")])
        answer = self._answer = ByteQueue(self.budget)
        task = self._tasks["answer"] = asyncio.get_running_loop().create_task(
            self._drain_answer(self._dealer, answer))
        try:
            while True:
                item = await answer.get()
                if item == END:
                    return
                if item == TIMEOUT:
                    raise ReplayTimeout
                if isinstance(item, Exception):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            task.cancel()
            answer.clear()

    async def _drain_answer(self, dealer: zmq.asyncio.Socket, answer: ByteQueue) -> None:
        """Move one replay answer into `answer`, at once, then its end (or TIMEOUT)."""
        try:
            for _ in range(self.max_replayed + 1):
                if not await dealer.poll(self.replay_timeout_s * 1000, zmq.POLLIN):
                    break
                frames = _buffers(await dealer.recv_multipart(copy=False))
                if len(frames) == 4 and not frames[0]:  # 0.32: [b"", topic, seq, payload]
                    if frames[2] == END_SEQ and not frames[1] and not frames[3]:
                        answer.put_marker(END)
                        return
                    self._queue(answer, self._parse(frames[1:]))
                elif len(frames) == 3 and not frames[0]:  # older: [b"", seq, payload], no topic
                    if frames[1] == END_SEQ and not frames[2]:
                        answer.put_marker(END)
                        return
                    # The replay socket is this publisher's own: its batches carry our topic.
                    self._queue(answer, self._parse([self.topic, *frames[1:]]))
                else:
                    self.counts["malformed"] += 1
            answer.put_marker(TIMEOUT)  # silent, or an answer without end: not vLLM's
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader
            answer.put_marker(e)

    def _parse(self, frames: list[memoryview]) -> Message | None:
        """(seq, payload) of a `[topic, seq, payload]` message, or None (counted) if malformed."""
        if (len(frames) == 3 and len(frames[1]) == 8 and len(frames[0]) <= MAX_TOPIC_BYTES
                and (not self.topic or frames[0] == self.topic)
                and 0 < len(frames[2]) <= self.max_payload_bytes):
            seq = int.from_bytes(frames[1], "big")
            if seq < MAX_SEQ:
                return seq, frames[2]
        self.counts["malformed"] += 1
        return None


def _buffers(frames: list[zmq.Frame]) -> list[memoryview]:
    """The frames' bytes where ZMQ received them: a batch is not copied once more."""
    return [frame.buffer for frame in frames]
