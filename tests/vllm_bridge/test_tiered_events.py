"""vLLM's KV offloading as the bridge sees it: the blocks its OffloadingConnector copies to CPU
memory or disk (BlockStored / BlockRemoved on medium "CPU" / "Disk", the GPU block's vLLM hash,
no tokens, vllm/v1/kv_offload/) are published in Tandem's host and disk tiers under the router's
own hashes; unknown media and blocks never seen on the GPU are left out and counted. Then end
to end: a fake vLLM's offload events through a real bridge into the per-tier sets in Redis."""

from __future__ import annotations

import asyncio

import pytest

from common.block_events import BlockEvent
from common.hashing import BlockHasher, hash_member
from tests.vllm_bridge.fake_vllm import stored
from tests.vllm_bridge.test_bridge import TOKENS, until, world
from vllm_bridge.chain import BlockChain
from vllm_bridge.encoding import encode_batch
from vllm_bridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)

HASHER = BlockHasher("m", 4)
OWN = HASHER(list(range(12)))  # the router's hashes of the three blocks below


def one(*events) -> EventBatch:
    return EventBatch(0.0, tuple(events), 0)


def on_gpu(hashes=(11, 12, 13)) -> BlockStored:
    return BlockStored(tuple(hashes), None, tuple(range(4 * len(hashes))), 4, None, 0, "GPU", None)


def offloaded(hashes, medium="CPU", block_size=0) -> BlockStored:
    """As vLLM's OffloadingConnector.take_events writes them."""
    return BlockStored(tuple(hashes), None, (), block_size, None, 0, medium, None)


def test_an_offloaded_block_evicted_from_the_gpu_stays_held_on_the_host():
    chain = BlockChain(HASHER)
    assert chain.apply(one(on_gpu())) == [BlockEvent("stored", tuple(OWN))]
    got = chain.apply(one(offloaded((11, 12, 13)), BlockRemoved((12, 13), "GPU", 0)))
    assert got == [BlockEvent("stored", tuple(OWN), "host"),
                   BlockEvent("removed", tuple(OWN[1:]))]
    assert chain.hashes_by_medium() == {"device": [OWN[0]], "host": list(OWN), "disk": []}
    assert len(chain) == 4  # one GPU mapping, three host ones
    # vLLM moves them on to disk (their GPU mapping gone: named by the host's), then drops
    # them from CPU memory; a second report of a block already there changes nothing.
    got = chain.apply(one(offloaded((12, 13), "Disk", 4), offloaded((13,), "DISK"),
                          BlockRemoved((12, 13), "CPU", 0)))
    assert got == [BlockEvent("stored", tuple(OWN[1:]), "disk"),
                   BlockEvent("removed", tuple(OWN[1:]), "host")]
    assert chain.apply(one(BlockRemoved((13,), "Disk", 0))) == [
        BlockEvent("removed", (OWN[2],), "disk")]
    assert chain.counts["stored"] == 3 + 3 + 2 and chain.counts["removed"] == 2 + 2 + 1


def test_a_raw_digest_names_the_block_the_gpu_named_by_its_low_64_bits():
    """GPU events carry int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default) while the
    offloading connector's carry the raw digest: the int is its big-endian low 64 bits."""
    digests = [bytes(range(i, i + 32)) for i in (1, 2)]
    ints = [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in digests]
    chain = BlockChain(HASHER)
    chain.apply(one(on_gpu(ints)))
    assert chain.apply(one(offloaded(digests), BlockRemoved(tuple(ints), "GPU", 0))) == [
        BlockEvent("stored", tuple(OWN[:2]), "host"), BlockEvent("removed", tuple(OWN[:2]))]
    assert chain.apply(one(BlockRemoved((digests[0],), "CPU", 0))) == [
        BlockEvent("removed", (OWN[0],), "host")]


def test_what_cannot_be_named_is_left_out_and_counted():
    chain = BlockChain(HASHER)
    chain.apply(one(on_gpu()))
    got = chain.apply(one(offloaded((99,)),  # never seen on the GPU (joined late)
                          offloaded((11,), block_size=8),  # one hash for two GPU blocks
                          offloaded((11,), "S3"), BlockRemoved((12,), "tape", 0)))
    assert got == []
    assert chain.counts["unknown_block"] == 2 and chain.counts["other_medium"] == 2
    assert chain.hashes_by_medium()["host"] == []


def test_a_gpu_reset_keeps_the_lower_tiers():
    chain = BlockChain(HASHER)
    chain.apply(one(on_gpu(), offloaded((11,))))
    assert chain.apply(one(AllBlocksCleared())) == [
        BlockEvent("cleared"), BlockEvent("stored", (OWN[0],), "host")]
    assert chain.hashes_by_medium() == {"device": [], "host": [OWN[0]], "disk": []}
    chain.clear()  # vLLM restarted: every tier forgotten
    assert len(chain) == 0 and chain.hashes_by_medium()["host"] == []


def test_overflow_clears_every_tier():
    chain = BlockChain(HASHER, max_blocks=4)
    chain.apply(one(on_gpu()))
    assert chain.apply(one(offloaded((11, 12)))) == [BlockEvent("cleared")]
    assert len(chain) == 0 and chain.counts["overflow"] == 1


@pytest.mark.parametrize("arrays", [False, True])
def test_offload_events_decode_from_the_wire(arrays):
    """vLLM's encoding of the connector's events: no tokens, block size 0 (newer releases) or
    the offloaded block's; block size 0 stays refused on the GPU."""
    for ev in (offloaded((b"\x01" * 32, 7)), offloaded((7,), "Disk", 16),
               BlockRemoved((b"\x02" * 32,), "CPU", 0)):
        got = decode_batch(encode_batch(one(ev), arrays=arrays)).events[0]
        assert got == ev
    gpu_zero = BlockStored((1,), None, (), 0, None, 0, "GPU", None)
    with pytest.raises(ValueError, match="block size 0"):
        decode_batch(encode_batch(one(gpu_zero), arrays=arrays))
    with pytest.raises(ValueError, match="token ids"):  # tokens on the GPU must match its blocks
        decode_batch(encode_batch(one(BlockStored((1,), None, (), 4, None, 0, "GPU", None)),
                                  arrays=arrays))


@pytest.mark.redis
def test_the_bridge_publishes_offloaded_blocks_in_the_host_tier():
    def tiered(ts: float) -> bytes:
        hashes = (1001, 1002, 1003)
        return encode_batch(EventBatch(ts, (offloaded(hashes),
                                            BlockRemoved(hashes[1:], "GPU", 0)), 0))

    async def go():
        async with world() as w:
            own = w.hasher(TOKENS)
            await until(w.registration, "the registration")
            await w.publish(lambda ts: stored([1001, 1002, 1003], TOKENS, ts=ts))
            await until(lambda: w.set_is(own), "the device set")
            await w.publish(tiered)
            host_key = w.keys.blocks(w.wid, "host")

            async def host_is_full() -> bool:
                got = await w.redis.smembers(host_key)
                return got == {hash_member(h).encode() for h in own}

            await until(host_is_full, "the host set")
            await until(lambda: w.set_is(own[:1]), "the device set after the eviction")
            assert await w.redis.scard(w.keys.blocks(w.wid, "disk")) == 0
            # A full rewrite (a new epoch) writes every tier from the chain.
            w.bridge.session.publisher.resync()
            await asyncio.sleep(0.2)
            await until(host_is_full, "the host set after a rewrite")
            assert await w.set_is(own[:1])

    asyncio.run(go())
