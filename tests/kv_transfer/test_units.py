"""One layer at a time: layout checks, descriptor coalescing, leases."""

import numpy as np
import pytest
import torch

from kv_transfer.descriptors import BlockRun, coalesce, descriptor_arrays
from kv_transfer.layout import BlockRangeError, KVLayout, LayoutMismatch
from kv_transfer.lease import LeaseTable
from kv_transfer.transports import get_transport_class, transport_names


def layout(**over) -> KVLayout:
    base = dict(model_id="m", dtype="float16", num_layers=2, block_size=4, num_kv_heads=2,
                head_dim=8, num_blocks=10)
    return KVLayout(**{**base, **over})


def test_layout_of_cache_and_sizes():
    cache = torch.zeros(7, 3, 2, 16, 3, 64, dtype=torch.bfloat16)
    lay = KVLayout.of_cache(cache, "smol")
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.dtype) == (3, 7, 16, "bfloat16")
    assert lay.run_bytes == 16 * 3 * 64 * 2
    assert lay.bytes_per_block == 3 * 2 * lay.run_bytes
    assert lay.region_bytes == cache.numel() * 2
    # Offsets are where the tensor says they are.
    assert lay.block_offset(5) == cache[5].data_ptr() - cache.data_ptr()
    assert lay.run_offset(2, 1, 5) == cache[5, 2, 1].data_ptr() - cache.data_ptr()
    with pytest.raises(ValueError, match="contiguous"):
        KVLayout.of_cache(cache.transpose(3, 4), "smol")


def test_compatibility_names_every_difference_and_ignores_block_count():
    a = layout()
    a.check_compatible(layout(num_blocks=999))
    with pytest.raises(LayoutMismatch) as e:
        a.check_compatible(layout(dtype="float32", head_dim=16, model_id="x"))
    msg = str(e.value)
    assert "dtype: 'float16' here vs 'float32' at the peer" in msg
    assert "head_dim: 8 here vs 16 at the peer" in msg and "model_id" in msg
    assert "num_layers" not in msg


def test_block_id_bounds():
    lay = layout(num_blocks=10)
    lay.check_block_ids([0, 9], "remote")
    for bad in ([10], [-1], [3, 2**40], ["1"]):
        with pytest.raises(BlockRangeError, match=r"out of range \[0, 10\)"):
            lay.check_block_ids(bad, "remote")


def test_coalesce_merges_runs_contiguous_on_both_sides():
    assert coalesce([1, 2, 3, 7, 8], [4, 5, 6, 0, 9]) == [
        BlockRun(1, 4, 3), BlockRun(7, 0, 1), BlockRun(8, 9, 1)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError):
        coalesce([1], [1, 2])


def test_descriptor_arrays_address_the_right_bytes():
    # Build real tensors and check that each descriptor pair copies the right run.
    src = torch.randn(6, 2, 2, 4, 2, 8).half()
    dst = torch.zeros(9, 2, 2, 4, 2, 8).half()
    lay = KVLayout.of_cache(src, "m")
    runs = coalesce([0, 1, 4], [7, 8, 2])
    s, d = descriptor_arrays(lay, src.data_ptr(), dst.data_ptr(), runs)
    # Two runs: blocks 0-1 -> 7-8 merge into one descriptor; 4 -> 2 is another.
    assert s.shape == d.shape == (2, 3) and (s[:, 1] == d[:, 1]).all()
    assert s[0, 1] == 2 * lay.bytes_per_block
    src_bytes = src.view(torch.uint8).reshape(-1).numpy()
    dst_bytes = dst.view(torch.uint8).reshape(-1).numpy()
    for (sa, n, _), (da, _, _) in zip(s.tolist(), d.tolist(), strict=True):
        so, do = sa - src.data_ptr(), da - dst.data_ptr()
        dst_bytes[do : do + n] = src_bytes[so : so + n]
    assert torch.equal(dst[[7, 8, 2]], src[[0, 1, 4]])
    assert dst[[0, 1, 3, 4, 5, 6]].abs().sum() == 0
    assert s.dtype == np.uint64


def test_lease_table_notify_expire_cancel_release_once():
    now = [100.0]
    released = []
    leases = LeaseTable(released.append, default_seconds=5, clock=lambda: now[0])
    leases.grant("a", [1, 2])
    leases.grant("b", [3], seconds=1)
    leases.grant("c", [4])
    assert leases.num_leased_blocks == 4
    with pytest.raises(ValueError, match="already holds"):
        leases.grant("a", [9])
    assert leases.complete("a") and not leases.complete("a")
    now[0] += 2
    assert leases.expire() == ["b"]
    assert leases.cancel("c") and not leases.cancel("c")
    assert released == ["a", "b", "c"] and len(leases) == 0
    assert (leases.num_granted, leases.num_notified, leases.num_expired) == (3, 1, 1)
    with pytest.raises(ValueError):
        LeaseTable(released.append, default_seconds=0)


def test_transport_table():
    assert set(transport_names()) == {"nixl", "tcp"}
    assert get_transport_class("tcp").name == "tcp"
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        get_transport_class("rdma")


def test_lease_watcher_wakes_as_soon_as_blocks_are_exported():
    """NIXL runs without its progress thread: a receiver's READ advances only while the sender
    polls. A grant must end the watcher's idle wait at once, not after the idle interval."""
    import asyncio

    from kv_transfer.connector import KVConnector
    from kv_transfer.transport import TransportConfig

    async def run() -> None:
        cache = torch.zeros(8, 2, 2, 4, 2, 8, dtype=torch.float16)
        connector = KVConnector(cache, KVLayout.of_cache(cache, "m"),
                                TransportConfig(engine_id="e"), "tcp", lambda rid: None,
                                idle_interval_s=60.0)
        await connector.start()
        try:
            polls = []
            completed = connector.transport.completed
            connector.transport.completed = lambda: (polls.append(1), completed())[1]
            await asyncio.sleep(0.2)  # the watcher is in its (60 s) idle wait now
            before = len(polls)
            connector.export("r1", [0, 1])
            for _ in range(500):  # up to ~5 s; the idle interval would take 60
                if len(polls) > before:
                    break
                await asyncio.sleep(0.01)
            assert len(polls) > before, "the watcher slept through a grant"
        finally:
            await connector.close()

    asyncio.run(run())
