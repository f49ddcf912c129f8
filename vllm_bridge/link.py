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
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

END_SEQ = b"\xff" * 8  # -1 as 8 signed bytes: the replay's end marker
MAX_SEQ = 1 << 62  # vLLM's seq is an itertools.count(); beyond this it is not vLLM's
MAX_TOPIC_BYTES = 1024


class ReplayTimeout(Exception):
    pass


class PublisherLink:
    """Connected by `open()`, closed by `close()`; `counts` is the subscriber's, shared."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes,
                 counts: dict[str, int], *, replay_timeout_s: float, max_payload_bytes: int,
                 max_buffered: int, max_replayed: int) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.counts = counts
        self.replay_timeout_s = replay_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.max_buffered = max_buffered  # live batches the SUB socket queues during a replay
        self.max_replayed = max_replayed  # batches one replay answer may hold
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._poller: zmq.asyncio.Poller | None = None
        self._disconnected = False

    def open(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._socket(zmq.SUB, self.endpoint, {zmq.RCVHWM: self.max_buffered,
                                                          zmq.SUBSCRIBE: self.topic})
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        if self.replay_endpoint:
            self.new_dealer()

    def _socket(self, kind: int, endpoint: str, options: dict | None = None) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        for option, value in (options or {}).items():  # before connecting: HWMs apply to new pipes
            sock.setsockopt(option, value)
        sock.setsockopt(zmq.LINGER, 0)
        # A peer that sends more than a payload's bound is cut off before it is buffered whole.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_payload_bytes + MAX_TOPIC_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    def new_dealer(self) -> None:
        """A fresh DEALER: what an abandoned or late replay answer still sends is never read."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
        assert self.replay_endpoint is not None
        self._dealer = self._socket(zmq.DEALER, self.replay_endpoint)

    def close(self) -> None:
        if self._ctx is None:
            return
        if self._sub is not None:
            self._sub.disable_monitor()
        for sock in (self._monitor, self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        self._ctx = None

    async def receive(self) -> tuple[int, bytes] | None:
        """The next valid live batch, or None when the SUB socket has just reconnected."""
        assert self._sub is not None and self._monitor is not None and self._poller is not None
        while True:
            ready = dict(await self._poller.poll())
            if self._monitor in ready:
                event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self._disconnected = True
                elif event == zmq.EVENT_CONNECTED and self._disconnected:
                    self._disconnected = False
                    return None
            if self._sub in ready:
                message = self._parse(await self._sub.recv_multipart())
                if message is not None:
                    return message

    async def replay(self, start: int) -> AsyncIterator[tuple[int, bytes]]:
        """The valid batches of one replay answer from `start`, up to its end marker; raises
        ReplayTimeout when the next message takes longer than `replay_timeout_s`."""
        assert self._dealer is not None
        dealer = self._dealer
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        for _ in range(self.max_replayed + 1):
            if not await dealer.poll(self.replay_timeout_s * 1000, zmq.POLLIN):
                raise ReplayTimeout
            frames = await dealer.recv_multipart()
            if len(frames) == 4 and not frames[0]:  # 0.32: [b"", topic, seq, payload]
                if frames[2] == END_SEQ and not frames[1] and not frames[3]:
                    return
                message = self._parse(frames[1:])
            elif len(frames) == 3 and not frames[0]:  # older: [b"", seq, payload], no topic
                if frames[1] == END_SEQ and not frames[2]:
                    return
                # The replay socket is this publisher's own: its batches carry our topic.
                message = self._parse([self.topic, *frames[1:]])
            else:
                self.counts["malformed"] += 1
                continue
            if message is not None:
                yield message
        raise ReplayTimeout  # an answer without end: not vLLM's

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        """(seq, payload) of a `[topic, seq, payload]` message, or None (counted) if malformed."""
        if (len(frames) == 3 and len(frames[1]) == 8 and len(frames[0]) <= MAX_TOPIC_BYTES
                and (not self.topic or frames[0] == self.topic)
                and 0 < len(frames[2]) <= self.max_payload_bytes):
            seq = int.from_bytes(frames[1], "big")
            if seq < MAX_SEQ:
                return seq, frames[2]
        self.counts["malformed"] += 1
        return None
