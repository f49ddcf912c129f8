"""The TCP fallback's zero-copy path (kv_transfer/payload.py): chunks that straddle blocks,
scattered ids, and a peer that cuts the payload short, between real processes."""

import random

import numpy as np
import pytest
import torch

from kv_transfer.payload import Regions, block_views
from tests.kv_transfer.peer import block_digests, make_cache
from tests.kv_transfer.peers import Peer

TOKEN = "s3cret"


def test_pieces_cover_exactly_the_asked_bytes():
    rng = random.Random(0)
    data = [bytes(rng.randrange(256) for _ in range(n)) for n in (5, 1, 17, 64, 3)]
    regions = Regions([memoryview(d) for d in data])
    whole = b"".join(data)
    assert regions.num_bytes == len(whole)
    for _ in range(200):
        a = rng.randrange(len(whole))
        b = rng.randrange(a, len(whole) + 1)
        assert b"".join(bytes(p) for p in regions.pieces(a, b)) == whole[a:b]


def test_block_views_write_through_to_the_cache():
    cache = torch.zeros(4, 2, 3, dtype=torch.float16)
    views = block_views(cache, [2, 0])
    assert [len(v) for v in views] == [12, 12]
    np.frombuffer(views[0], dtype=np.uint8)[:] = 0x3C  # 0x3C3C as float16 is 1.0547
    assert torch.all(cache[2] != 0) and torch.all(cache[0] == 0) and torch.all(cache[1] == 0)


@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 1 << 20])
def test_scattered_pull_with_chunks_across_block_edges_is_bit_exact(chunk_bytes):
    sender = Peer("tcp", "P1", num_blocks=64, seed=3, token=TOKEN, chunk_bytes=chunk_bytes)
    receiver = Peer("tcp", "D1", num_blocks=64, seed=4, token=TOKEN)
    try:
        src = [63, 0, 17, 18, 19, 5, 40, 2, 33, 9, 10, 61, 60, 7, 8, 50]  # 16 scattered
        dst = [1, 2, 3, 4, 20, 21, 22, 30, 31, 32, 40, 41, 42, 50, 51, 52]
        before = receiver.send("digest")["digests"]
        sender.send("export", request_id="scatter", block_ids=src)
        stats = receiver.send("pull", url=sender.url, engine_id="P1", request_id="scatter",
                              remote_block_ids=src, local_block_ids=dst)
        assert "error" not in stats, stats
        got = receiver.send("digest")["digests"]
        want = block_digests(make_cache(64, seed=3))
        assert [got[d] for d in dst] == [want[s] for s in src]
        assert all(got[b] == before[b] for b in set(range(64)) - set(dst))
    finally:
        sender.close()
        receiver.close()
