"""What a publisher can make the bridge hold (issue 38 item 6), piece by piece: the byte budget
of its queues, a batch dropped past it (a gap the replay fills), the decoding of one event at a
time, the bounds per batch, the settings that hold them, and a frame over the size bound, which
once ended the subscription for good (ZMQ does not reconnect after it). The whole bridge under a
flood: test_bridge_flood.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tests.vllm_bridge.test_subscriber import WAIT_S, harness, seqs
from vllm_bridge import events as ev
from vllm_bridge.byte_queue import ITEM_OVERHEAD_BYTES, ByteBudget, ByteQueue
from vllm_bridge.events import BatchReader, BlockStored
from vllm_bridge.settings import BridgeSettings


async def until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_queues_sharing_a_budget_refuse_what_does_not_fit():
    async def go():
        budget = ByteBudget(3 * (100 + ITEM_OVERHEAD_BYTES))
        live, answer = ByteQueue(budget), ByteQueue(budget)
        assert live.put("a", 100) and live.put("b", 100) and answer.put("c", 100)
        assert not answer.put("d", 1) and not live.put("e", 0)  # the overhead counts too
        live.put_marker("reconnected")  # markers hold nothing and always fit
        assert await live.get() == "a" and budget.used == 2 * (100 + ITEM_OVERHEAD_BYTES)
        assert answer.put("d", 100)
        answer.clear()
        assert budget.used == 100 + ITEM_OVERHEAD_BYTES
        assert [await live.get(), await live.get()] == ["b", "reconnected"] and budget.used == 0
        assert ByteQueue(ByteBudget(10)).put("a batch over the budget", 100)  # one always fits

    asyncio.run(go())


def test_a_batch_dropped_past_the_byte_budget_is_a_gap_filled_by_replay(tmp_path):
    """While the reader is busy, two 1000-byte batches fit the budget and the third does not:
    dropped and counted. The next batch shows the gap and the replay brings the third back."""
    big = 1000 + ITEM_OVERHEAD_BYTES

    async def go():
        async with harness(tmp_path, start=False, max_queued_bytes=2 * big + 300) as h:
            items = h.sub.items().__aiter__()
            first = asyncio.ensure_future(items.__anext__())
            try:
                await h.pub.subscribed(WAIT_S)
                await until(lambda: h.pub.num_replays >= 1, "the start's replay")
                await h.pub.publish(b"0" * 10)
                assert (await asyncio.wait_for(first, WAIT_S)).seq == 0
                for data in (b"1" * 1000, b"2" * 1000, b"3" * 1000, b"4" * 10):
                    await h.pub.publish(data)
                await until(lambda: h.sub.counts["dropped"] == 1
                            and h.sub.link.budget.used == 2 * big + 10 + ITEM_OVERHEAD_BYTES,
                            "1, 2 and 4 queued, 3 dropped")
                got = [await asyncio.wait_for(items.__anext__(), WAIT_S) for _ in range(4)]
                assert seqs(got) == [1, 2, 3, 4] and got[2].payload == b"3" * 1000
                counts = h.sub.counts
                assert counts["gaps"] == 1 and counts["reset_history_lost"] == 0
                assert h.sub.link.budget.used == 0
            finally:
                await items.aclose()

    asyncio.run(go())


def test_a_frame_over_the_bound_does_not_end_the_subscription(tmp_path):
    """ZMQ drops the connection of a peer that sends a frame over MAXMSGSIZE and, a protocol
    error, never reconnects it: the link connects anew, and the replay fills what was missed."""
    async def go():
        async with harness(tmp_path, max_payload_bytes=1000) as h:
            await h.publish(0.0)
            assert seqs(await h.take(1)) == [0]
            h.pub._subscribed = asyncio.Event()  # set again by the new connection's subscription
            await h.pub.send_raw([b"", (1).to_bytes(8, "big"), b"x" * 5000])
            await h.publish(1.0, live=False)  # sent while the link is down: replayed
            await h.pub.subscribed(WAIT_S)
            await h.publish(2.0)
            assert seqs(await h.take(2)) == [1, 2]
            assert h.sub.counts["reconnects"] == 1

    asyncio.run(go())


def _stored(num_tokens: int, block_size: int = 4) -> dict:
    n = num_tokens // block_size
    return {"type": "BlockStored", "block_hashes": list(range(n)), "parent_block_hash": None,
            "token_ids": [7] * num_tokens, "block_size": block_size, "lora_id": None,
            "medium": "GPU", "lora_name": None}


def test_events_decode_one_at_a_time_within_the_batch_bounds():
    payload = msgspec.msgpack.encode([1.0, [_stored(8), {"type": "Unknown"}, _stored(8)], 0])
    reader = BatchReader(payload)
    events = iter(reader)
    assert isinstance(next(events), BlockStored) and reader.num_unknown == 0
    assert isinstance(next(events), BlockStored) and reader.num_unknown == 1

    # a batch at the bound of token ids decodes; one more token id is refused
    per_event = ev.MAX_TOKENS_PER_EVENT
    at_bound = [_stored(per_event, 16)] * (ev.MAX_TOKENS_PER_BATCH // per_event)
    assert len(ev.decode_batch(msgspec.msgpack.encode([1.0, at_bound, 0])).events) == 2
    over = msgspec.msgpack.encode([1.0, [*at_bound, _stored(4)], 0])
    with pytest.raises(ValueError, match="token ids"):
        ev.decode_batch(over)
    assert len(over) < ev.MAX_PAYLOAD_BYTES  # the payload bound alone would not have caught it


def test_settings_bound_the_queue_and_the_batch():
    s = BridgeSettings(vllm_url="http://h:1")
    assert s.max_payload_bytes == ev.MAX_PAYLOAD_BYTES == 16 << 20
    assert s.max_queued_bytes == 32 << 20
    for bad in ({"max_payload_bytes": (16 << 20) + 1},
                {"max_payload_bytes": 1 << 20, "max_queued_bytes": (1 << 20) - 1}):
        with pytest.raises(ValueError):
            BridgeSettings(vllm_url="http://h:1", **bad)
