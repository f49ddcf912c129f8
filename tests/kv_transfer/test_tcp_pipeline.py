"""The TCP fallback's staged path (kv_transfer/tcp_pipeline.py): units of whole blocks through two
host buffers, each side with its own unit size, wire chunks that cut across units. On CPU the
same code runs with plain buffers (`staging="always"`); the `gpu` tests are its VRAM twins."""

import asyncio

import pytest
import torch

from kv_transfer.layout import KVLayout
from kv_transfer.side_stream import SideStream
from kv_transfer.tcp_pipeline import (
    HostBuffers,
    RecvUnits,
    SendUnits,
    blocks_per_unit,
    record_bytes,
    units,
)
from tests.kv_transfer.peer import block_digests, make_cache
from tests.kv_transfer.peers import Peer

TOKEN = "s3cret"
SRC = [63, 0, 17, 18, 19, 5, 40, 2, 33, 9, 10, 61, 60, 7, 8, 50]
DST = [1, 2, 3, 4, 20, 21, 22, 30, 31, 32, 40, 41, 42, 50, 51, 52]


def test_units_cover_the_pull_in_whole_blocks():
    assert units(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert units(3, 8) == [(0, 3)] and units(0, 2) == []
    with pytest.raises(ValueError):
        units(3, 0)
    lay = KVLayout.of_cache(make_cache(1, 0), "m")  # 49,152-byte blocks
    assert record_bytes(lay, False) == lay.bytes_per_block
    assert record_bytes(lay, True) == lay.bytes_per_block // 2 + 4 * 2 * 4
    assert blocks_per_unit(lay, False, 16 << 20) == (16 << 20) // lay.bytes_per_block
    assert blocks_per_unit(lay, False, 1) == 1  # never less than a block
    assert blocks_per_unit(lay, True, 1, min_bytes=60_000) == 3  # wire chunks of >= 4 KiB


async def roundtrip(fp8: bool, send_chunk: int, recv_chunk: int, wire_chunk: int | None = None):
    src = make_cache(64, seed=1)
    dst = make_cache(64, seed=2)
    lay = KVLayout.of_cache(src, "m")
    side = SideStream(src.device)
    send_buffers, recv_buffers = HostBuffers(src.device), HostBuffers(src.device)
    send = SendUnits(src, SRC, lay, fp8, send_chunk, send_buffers, side)
    recv = RecvUnits(dst, DST, lay, fp8, recv_chunk, recv_buffers, side)
    payload = bytearray()
    try:
        async for view in send:
            payload += bytes(view)
        assert len(payload) == recv.num_bytes
        wire_chunk = wire_chunk or send.unit_bytes
        for start in range(0, len(payload), wire_chunk):
            end = min(start + wire_chunk, len(payload))
            pos = start
            async for view in recv.views(start, end):
                view[:] = payload[pos: pos + len(view)]
                pos += len(view)
            assert pos == end
        await recv.finish()
    finally:
        send.close()
        recv.close()
    assert send_buffers.num_idle == min(2, len(send.units))  # every buffer given back
    assert recv_buffers.num_idle == min(2, len(recv.units))
    return src, dst


@pytest.mark.parametrize("send_chunk,recv_chunk,wire_chunk", [
    (1, 1, None), (3 * 49_152, 5 * 49_152, None), (1 << 20, 2 * 49_152, 7_000),
    (5 * 49_152, 1, 4_096)])
def test_units_of_different_sizes_on_each_side_land_every_block_bit_exact(
        send_chunk, recv_chunk, wire_chunk):
    src, dst = asyncio.run(roundtrip(False, send_chunk, recv_chunk, wire_chunk))
    before = make_cache(64, seed=2)
    assert torch.equal(dst[DST], src[SRC])
    untouched = sorted(set(range(64)) - set(DST))
    assert torch.equal(dst[untouched], before[untouched])


def test_fp8_records_carry_each_blocks_scales():
    src, dst = asyncio.run(roundtrip(True, 2 * 49_152, 3 * 49_152, 5_000))
    got, want = dst[DST].float(), src[SRC].float()
    err = (got - want).abs().amax(dim=(3, 4, 5))  # per (block, layer, K/V) run
    assert (err <= want.abs().amax(dim=(3, 4, 5)) * 2**-4 + 1e-3).all()
    assert not torch.equal(got, want)


@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 1 << 20])
def test_staged_tcp_pull_between_processes_is_bit_exact(chunk_bytes):
    """CPU twin of a CUDA cache's TCP path: both sides staged, unit sizes from different chunk
    sizes."""
    sender = Peer("tcp", "P1", num_blocks=64, seed=3, token=TOKEN, chunk_bytes=chunk_bytes,
                  staging="always")
    receiver = Peer("tcp", "D1", num_blocks=64, seed=4, token=TOKEN, staging="always",
                    chunk_bytes=3 * 49_152)
    try:
        before = receiver.send("digest")["digests"]
        sender.send("export", request_id="staged", block_ids=SRC)
        stats = receiver.send("pull", url=sender.url, engine_id="P1", request_id="staged",
                              remote_block_ids=SRC, local_block_ids=DST)
        assert "error" not in stats, stats
        got = receiver.send("digest")["digests"]
        want = block_digests(make_cache(64, seed=3))
        assert [got[d] for d in DST] == [want[s] for s in SRC]
        assert all(got[b] == before[b] for b in set(range(64)) - set(DST))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.gpu
@pytest.mark.parametrize("sender_device,receiver_device,fp8", [
    ("cuda", "cuda", False), ("cuda", "cpu", False), ("cpu", "cuda", False),
    ("cuda", "cuda", True)])
def test_gpu_tcp_pulls_from_and_into_vram(sender_device, receiver_device, fp8):
    sender = Peer("tcp", "P2", num_blocks=64, seed=3, token=TOKEN, device=sender_device,
                  chunk_bytes=5 * 49_152)
    receiver = Peer("tcp", "D2", num_blocks=64, seed=4, token=TOKEN,
                    device=receiver_device, fp8=fp8, chunk_bytes=3 * 49_152)
    try:
        sender.send("export", request_id="g", block_ids=SRC)
        stats = receiver.send("pull", url=sender.url, engine_id="P2", request_id="g",
                              remote_block_ids=SRC, local_block_ids=DST)
        assert "error" not in stats, stats
        if fp8:
            got = torch.tensor(receiver.send("blocks", block_ids=DST)["values"])
            want = make_cache(64, seed=3)[SRC].float()
            err = (got - want).abs().amax(dim=(3, 4, 5))
            assert (err <= want.abs().amax(dim=(3, 4, 5)) * 2**-4 + 1e-3).all()
        else:
            got = receiver.send("digest")["digests"]
            want = block_digests(make_cache(64, seed=3))
            assert [got[d] for d in DST] == [want[s] for s in SRC]
    finally:
        sender.close()
        receiver.close()
