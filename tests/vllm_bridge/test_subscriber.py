"""The subscriber against a fake vLLM publisher with vLLM's framing (real ZMQ sockets): in-order
delivery, gaps filled by replay or reset when they cannot be, a restart, a late joiner, a trimmed
replay buffer, malformed messages, no replay endpoint, a replay that never answers."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio

from tests.vllm_bridge import captures
from tests.vllm_bridge.fake_vllm import FakePublisher
from vllm_bridge.encoding import encode_batch
from vllm_bridge.events import EventBatch
from vllm_bridge.subscriber import Batch, EventSubscriber, Reset

WAIT_S = 10.0  # a guard against hanging, never a condition


def payload(ts: float) -> bytes:
    return encode_batch(EventBatch(ts, (), 0))


class Harness:
    def __init__(self, pub: FakePublisher, sub: EventSubscriber) -> None:
        self.pub, self.sub = pub, sub
        self.items: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        async def consume() -> None:
            async for item in self.sub.items():
                await self.items.put(item)

        self.task = asyncio.create_task(consume())
        await self.pub.subscribed(WAIT_S)
        if self.sub.has_replay:  # the start's replay is answered: what follows is live
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while self.pub.num_replays < 1 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert self.pub.num_replays >= 1, "the subscriber asked for no replay at its start"

    async def take(self, n: int) -> list:
        return [await asyncio.wait_for(self.items.get(), WAIT_S) for _ in range(n)]

    async def publish(self, *timestamps: float, live: bool = True) -> None:
        for ts in timestamps:
            await self.pub.publish(payload(ts), live=live)


@contextlib.asynccontextmanager
async def harness(tmp_path, *, replay: bool = True, buffer_steps: int = 10_000, topic: str = "",
                  start: bool = True, replay_topic: bool = True, **options):
    pub = FakePublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay" if replay else None,
                        topic, buffer_steps, replay_topic)
    await pub.start()
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint, topic, **options)
    h = Harness(pub, sub)
    try:
        if start:
            await h.start()
        yield h
    finally:
        if h.task is not None:
            h.task.cancel()
            await asyncio.gather(h.task, return_exceptions=True)
        await pub.close()


def seqs(items) -> list:
    return [i.seq if isinstance(i, Batch) else i.reason for i in items]


def run(coro) -> None:
    asyncio.run(coro)


def test_in_order_delivery(tmp_path):
    async def go():
        async with harness(tmp_path) as h:
            await h.publish(0.0, 1.0, 2.0)
            got = await h.take(3)
            assert seqs(got) == [0, 1, 2]
            assert [i.payload for i in got] == [payload(0.0), payload(1.0), payload(2.0)]
            assert h.sub.counts["gaps"] == 0 and h.sub.counts["batches"] == 3

    run(go())


def test_a_gap_is_filled_by_replay(tmp_path):
    async def go():
        async with harness(tmp_path) as h:
            await h.publish(0.0, 1.0)
            await h.publish(2.0, 3.0, live=False)  # the subscriber misses 2 and 3
            await h.publish(4.0)
            got = await h.take(5)
            assert seqs(got) == [0, 1, 2, 3, 4]
            assert got[3].payload == payload(3.0)
            assert h.sub.counts["gaps"] == 1 and h.sub.counts["reset_history_lost"] == 0
            await h.publish(5.0)  # live again, and 4 (replayed, then live) came once
            assert seqs(await h.take(1)) == [5]

    run(go())


def test_a_gap_replay_cannot_fill_resets(tmp_path):
    async def go():
        async with harness(tmp_path, buffer_steps=2) as h:
            await h.publish(0.0, 1.0)
            await h.publish(2.0, 3.0, live=False)
            await h.publish(4.0)  # the buffer holds 3 and 4: 2 is gone
            got = await h.take(5)
            assert seqs(got) == [0, 1, "history_lost", 3, 4]
            assert h.sub.counts["reset_history_lost"] == 1

    run(go())


def test_a_restart_resets_and_catches_up_from_zero(tmp_path):
    async def go():
        async with harness(tmp_path) as h:
            await h.publish(0.0, 1.0, 2.0)
            assert seqs(await h.take(3)) == [0, 1, 2]
            await h.pub.restart()  # seqs from 0 again, an empty buffer
            await h.pub.subscribed(WAIT_S)
            await h.publish(10.0, 11.0)
            got = await h.take(3)
            assert seqs(got) == ["restarted", 0, 1]
            assert got[1].payload == payload(10.0)
            await h.publish(12.0)
            assert seqs(await h.take(1)) == [2]
            assert h.sub.counts["reset_restarted"] == 1

    run(go())


def test_a_restart_that_already_passed_the_old_seqs_is_seen(tmp_path):
    """The new process has sent more batches than the old one before the subscriber hears it:
    no seq goes back, but the batch at the last seq delivered is another one."""
    async def go():
        async with harness(tmp_path) as h:
            await h.publish(0.0, 1.0)
            assert seqs(await h.take(2)) == [0, 1]
            await h.pub.close()
            h.pub.seq = 0
            h.pub.buffer.clear()
            await h.publish(20.0, 21.0, 22.0, live=False)  # sent before the subscriber reconnects
            await h.pub.start()
            await h.pub.subscribed(WAIT_S)
            await h.publish(23.0)
            got = await h.take(5)
            assert seqs(got) == ["restarted", 0, 1, 2, 3]
            assert [i.payload for i in got[1:]] == [payload(t) for t in (20.0, 21.0, 22.0, 23.0)]

    run(go())


def test_a_late_joiner_gets_the_history_by_replay(tmp_path):
    async def go():
        async with harness(tmp_path, start=False) as h:
            await h.publish(0.0, 1.0, 2.0, 3.0, 4.0, live=False)  # before the bridge starts
            await h.start()
            got = await h.take(5)
            assert seqs(got) == [0, 1, 2, 3, 4]
            await h.publish(5.0)
            assert seqs(await h.take(1)) == [5]
            assert h.sub.counts["reset_history_lost"] == 0

    run(go())


def test_replay_answers_without_the_topic_frame_from_older_vllm(tmp_path):
    """vLLM before 0.32 (vllm#45174) answered `[b"", seq, payload]` and `[b"", -1, b""]`: a
    late joiner's history and a gap are replayed from it as from 0.32's four frames."""
    async def go():
        async with harness(tmp_path, topic="kv@old", replay_topic=False, start=False) as h:
            await h.publish(0.0, 1.0, 2.0, live=False)  # before the bridge starts
            await h.start()
            got = await h.take(3)
            assert seqs(got) == [0, 1, 2] and got[2].payload == payload(2.0)
            await h.publish(3.0, live=False)  # missed: replayed when 4 shows the gap
            await h.publish(4.0)
            assert seqs(await h.take(2)) == [3, 4]
            counts = h.sub.counts
            assert (counts["gaps"] == 1 and counts["malformed"] == 0
                    and counts["replay_timeouts"] == 0)
            assert counts["reset_history_lost"] == counts["reset_restarted"] == 0

    run(go())


def test_a_trimmed_replay_buffer_means_history_lost(tmp_path):
    async def go():
        async with harness(tmp_path, buffer_steps=3, start=False) as h:
            await h.publish(0.0, 1.0, 2.0, 3.0, 4.0, live=False)
            await h.start()
            got = await h.take(4)
            assert seqs(got) == ["history_lost", 2, 3, 4]

    run(go())


def test_malformed_messages_are_counted_and_skipped(tmp_path):
    async def go():
        async with harness(tmp_path, topic="kv@a", max_payload_bytes=1000) as h:
            await h.publish(0.0)
            assert seqs(await h.take(1)) == [0]
            seq1 = (1).to_bytes(8, "big")
            for frames in ([b"kv@a", seq1], [b"kv@a", seq1, payload(1.0), b"x"],
                           [b"kv@a", b"\x00" * 7, payload(1.0)], [b"kv@ab", seq1, payload(1.0)],
                           [b"kv@a", seq1, b""], [b"kv@a", seq1, b"x" * 1001],
                           [b"kv@a", b"\x7f" * 8, payload(1.0)]):
                await h.pub.send_raw(frames)
            await h.publish(1.0)
            got = await h.take(1)
            assert seqs(got) == [1] and got[0].payload == payload(1.0)
            assert h.sub.counts["malformed"] == 7 and h.sub.counts["gaps"] == 0

    run(go())


def test_without_replay_gaps_and_restarts_reset_directly(tmp_path):
    async def go():
        async with harness(tmp_path, replay=False) as h:
            await h.publish(0.0, 1.0)
            await h.publish(2.0, live=False)
            await h.publish(3.0)
            assert seqs(await h.take(4)) == [0, 1, "history_lost", 3]
            await h.pub.restart()
            await h.pub.subscribed(WAIT_S)
            await h.publish(10.0)
            got = await h.take(2)
            assert isinstance(got[0], Reset) and got[0].reason in ("reconnected", "restarted")
            assert seqs(got[1:]) == [0]

    run(go())


def test_a_replay_without_answer_resets_and_goes_on(tmp_path):
    async def go():
        async with harness(tmp_path, replay_timeout_s=0.2) as h:
            await h.publish(0.0)
            assert seqs(await h.take(1)) == [0]
            h.pub.answer_replays = False
            await h.publish(1.0, live=False)
            await h.publish(2.0)
            assert seqs(await h.take(2)) == ["history_lost", 2]
            assert h.sub.counts["replay_timeouts"] == 1
            h.pub.answer_replays = True  # the DEALER was made anew: replays work again
            await h.publish(3.0, live=False)
            await h.publish(4.0)
            assert seqs(await h.take(2)) == [3, 4]

    run(go())


@pytest.mark.parametrize("arrays", [False, True])
def test_payloads_pass_through_unchanged(tmp_path, arrays):
    async def go():
        async with harness(tmp_path) as h:
            data = encode_batch(EventBatch(5.0, (), 0), arrays=arrays)
            await h.pub.publish(data)
            assert (await h.take(1))[0].payload == data

    run(go())


# ---- the golden capture of a real vLLM 0.32 server ---------------------------------------------


def test_the_fake_answers_replays_as_the_captured_vllm_did(tmp_path):
    """The fake's framing is vLLM's: fed the captured batches, it answers a DEALER from seq 0,
    3 and past the end with the frames the real server sent."""
    async def go():
        pub = FakePublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay",
                            captures.server()["topic"])
        await pub.start()
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        try:
            for _, _, data in captures.batches():
                await pub.publish(data, live=False)
            for start, want in captures.replays().items():
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                got = [await asyncio.wait_for(dealer.recv_multipart(), WAIT_S) for _ in want]
                assert got == want
        finally:
            ctx.destroy(linger=0)
            await pub.close()

    run(go())


def test_golden_batches_arrive_byte_for_byte(tmp_path):
    async def go():
        topic = captures.server()["topic"]
        async with harness(tmp_path, topic=topic, start=False) as h:
            golden = captures.payloads()
            for data in golden[:4]:  # before the subscriber starts: replayed
                await h.pub.publish(data, live=False)
            await h.start()
            for data in golden[4:]:
                await h.pub.publish(data)
            got = await h.take(len(golden))
            assert seqs(got) == list(range(len(golden)))
            assert [i.payload for i in got] == golden

    run(go())
