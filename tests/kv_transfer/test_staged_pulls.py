"""Staged NIXL pulls between two processes: each plan moves bit-exact blocks, staging slots are
given back on every path (notification, expiry, cancel, a refused pull, a killed receiver), the
lane label is read without any environment set by hand. The CPU tests run the same staging code
as on a GPU (the torch reference gather/scatter instead of the kernels); the `gpu` tests are
their VRAM twins and fail if UCX falls back to host staging."""


import pytest

from kv_transfer.nixl_transport import nixl_available
from tests.kv_transfer.peer import SHAPE, block_digests, make_cache
from tests.kv_transfer.peers import Peer, wait_for

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not nixl_available(), reason="nixl-cu12 is not installed")]
BLOCK_BYTES = (SHAPE["num_layers"] * 2 * SHAPE["block_size"] * SHAPE["num_kv_heads"]
               * SHAPE["head_dim"] * 2)
SRC = [5, 40, 7, 30, 2, 63, 11, 12, 13, 50]  # scattered, one run of three
DST = [10, 3, 12, 0, 47, 20, 33, 34, 35, 1]


def pair(device="cpu", sender_staging="always", receiver_staging="always", env=None,
         part_blocks=None, **sender_opts):
    """`part_blocks`: the receiver READs into its staging slots in parts of this many blocks."""
    sender = Peer("nixl", "P", num_blocks=64, seed=1, device=device, staging=sender_staging,
                  env=env, **sender_opts)
    parts = {} if part_blocks is None else {"pipeline_part_bytes": part_blocks * BLOCK_BYTES}
    receiver = Peer("nixl", "D", num_blocks=48, seed=2, device=device,
                    staging=receiver_staging, env=env, **parts)
    return sender, receiver


def check_moved(receiver, src, dst, before):
    got = receiver.send("digest")["digests"]
    want = block_digests(make_cache(64, seed=1))
    assert [got[d] for d in dst] == [want[s] for s in src]
    assert all(got[b] == before[b] for b in set(range(48)) - set(dst))


def pull_all_plans(sender, receiver):
    """Every plan on one pair: (plan, label) per pull; leaves nothing leased."""
    out = []
    before = receiver.send("digest")["digests"]
    exported = sender.send("export", request_id="both", block_ids=SRC)
    start = exported["remote_staging_start"]
    assert sender.send("state")["staging_slots"] == len(SRC)
    stats = receiver.send("pull", url=sender.url, engine_id="P", request_id="both",
                          remote_block_ids=SRC, local_block_ids=DST,
                          staged_slots=list(range(start, start + len(SRC))))
    assert "error" not in stats, stats
    out.append((stats["plan"], stats["label"]))
    assert stats["num_descriptors"] == 1
    assert set(stats["phases_us"]) == {"prepare", "read", "scatter", "notify"}
    check_moved(receiver, SRC, DST, before)
    # A partial pull of a staged export (the receiver had the first four blocks): slots offset.
    exported = sender.send("export", request_id="part", block_ids=SRC)
    start = exported["remote_staging_start"]
    stats = receiver.send("pull", url=sender.url, engine_id="P", request_id="part",
                          remote_block_ids=SRC[4:], local_block_ids=[40, 41, 42, 43, 44, 45],
                          staged_slots=list(range(start + 4, start + len(SRC))))
    assert "error" not in stats, stats
    out.append((stats["plan"], stats["label"]))
    got = receiver.send("digest")["digests"]
    want = block_digests(make_cache(64, seed=1))
    assert [got[d] for d in (40, 41, 42, 43, 44, 45)] == [want[s] for s in SRC[4:]]
    # Not staged by the sender (no slots named): the receiver stages alone.
    sender.send("export", request_id="local", block_ids=[20, 21, 22, 23])
    stats = receiver.send("pull", url=sender.url, engine_id="P", request_id="local",
                          remote_block_ids=[20, 21, 22, 23], local_block_ids=[5, 9, 14, 2])
    assert "error" not in stats, stats
    out.append((stats["plan"], stats["label"]))
    got = receiver.send("digest")["digests"]
    assert [got[d] for d in (5, 9, 14, 2)] == [want[s] for s in (20, 21, 22, 23)]
    state = wait_for(lambda: (s := sender.send("state"))["leases"] == 0 and s)
    assert state["staging_slots"] == 0 and state["staging_leases"] == 0
    assert receiver.send("state")["staging_slots"] == 0
    return out


@pytest.mark.parametrize("part_blocks", [None, 3])
def test_every_staged_plan_moves_bit_exact_blocks_and_frees_its_slots(part_blocks):
    # In parts of 3 blocks, the 10-block pull is READ as 3 parts posted at once, each scattered
    # while the next lands (the GPU twin does the same with the CUDA scatter).
    sender, receiver = pair(part_blocks=part_blocks)
    try:
        plans = pull_all_plans(sender, receiver)
        assert [p for p, _ in plans] == ["staged_both", "staged_both", "staged_local"]
        # The lane is read from UCX's own log, with no UCX variable set by hand.
        assert all(label.startswith("ucx:") and label != "ucx:" for _, label in plans), plans
    finally:
        sender.close()
        receiver.close()


def test_auto_keeps_cpu_pulls_per_descriptor_and_reads_staged_slots_only_when_asked():
    sender, receiver = pair(sender_staging="auto", receiver_staging="auto")
    try:
        exported = sender.send("export", request_id="a", block_ids=SRC)
        assert "remote_staging_start" not in exported  # CPU caches: not worth a copy
        before = receiver.send("digest")["digests"]
        stats = receiver.send("pull", url=sender.url, engine_id="P", request_id="a",
                              remote_block_ids=SRC, local_block_ids=DST)
        assert stats["plan"] == "direct" and stats["num_descriptors"] == 8
        check_moved(receiver, SRC, DST, before)
    finally:
        sender.close()
        receiver.close()


def test_staging_slots_are_freed_on_expiry_cancel_and_when_full():
    # Room for 12 blocks of staging: the second export of 10 does not fit and goes unstaged.
    sender = Peer("nixl", "P", num_blocks=64, seed=1, staging="always",
                  staging_bytes=12 * BLOCK_BYTES, lease_seconds=30)
    try:
        first = sender.send("export", request_id="x", block_ids=SRC, lease_seconds=0.3)
        second = sender.send("export", request_id="y", block_ids=SRC)
        assert first["remote_staging_start"] == 0 and "remote_staging_start" not in second
        state = wait_for(lambda: (s := sender.send("state"))["expired"] == 1 and s)
        assert state["staging_slots"] == 0  # expiry gave the slots back
        third = sender.send("export", request_id="z", block_ids=SRC[:5])
        assert third["remote_staging_start"] == 0
        assert sender.send("state")["staging_slots"] == 5
        assert sender.send("cancel", request_id="z")["cancelled"]
        assert sender.send("cancel", request_id="y")["cancelled"]
        state = sender.send("state")
        assert state["staging_slots"] == 0 and state["leases"] == 0
    finally:
        sender.close()


def test_refused_and_abandoned_pulls_leak_no_staging():
    sender, receiver = pair()
    try:
        exported = sender.send("export", request_id="bad", block_ids=SRC, lease_seconds=0.5)
        start = exported["remote_staging_start"]
        out = receiver.send("pull", url=sender.url, engine_id="P", request_id="bad",
                            remote_block_ids=SRC, local_block_ids=DST,
                            staged_slots=list(range(start + 60, start + 70)))
        assert out["error"] == "BlockRangeError" and "staged slots" in out["message"]
        assert receiver.send("state")["staging_slots"] == 0
        state = wait_for(lambda: (s := sender.send("state"))["expired"] == 1 and s)
        assert state["staging_slots"] == 0
        # A receiver killed mid-pull: the sender's lease runs out and takes the slots with it.
        blocks = list(range(0, 64, 2))
        exported = sender.send("export", request_id="doomed", block_ids=blocks, lease_seconds=1.0)
        start = exported["remote_staging_start"]
        receiver.send_nowait("pull", url=sender.url, engine_id="P", request_id="doomed",
                             remote_block_ids=blocks[:24], local_block_ids=list(range(24)),
                             staged_slots=list(range(start, start + 24)))
        receiver.kill()
        state = wait_for(lambda: (s := sender.send("state"))["leases"] == 0 and s)
        assert state["staging_slots"] == 0 and "doomed" in state["released"]
    finally:
        sender.close()
        receiver.close()


# ---- GPU twins --------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_vram_pulls_take_cuda_ipc_with_no_host_staging_fallback():
    """Same plans on VRAM caches. UCX_PROTO_EMULATION_ENABLE=n turns a fallback to host staging
    into an error, and the label must name cuda_ipc."""
    sender, receiver = pair("cuda", env={"UCX_PROTO_EMULATION_ENABLE": "n"}, part_blocks=3)
    try:
        plans = pull_all_plans(sender, receiver)
        assert [p for p, _ in plans] == ["staged_both", "staged_both", "staged_local"]
        assert all(label == "ucx:cuda_ipc" for _, label in plans), plans
    finally:
        sender.close()
        receiver.close()


@pytest.mark.gpu
def test_gpu_auto_plans_stage_scattered_vram_pulls():
    sender, receiver = pair("cuda", "auto", "auto", env={"UCX_PROTO_EMULATION_ENABLE": "n"})
    try:
        src = list(range(63, 0, -2))[:24]  # 24 scattered blocks
        dst = list(range(0, 48, 2))
        exported = sender.send("export", request_id="g", block_ids=src)
        start = exported["remote_staging_start"]
        before = receiver.send("digest")["digests"]
        stats = receiver.send("pull", url=sender.url, engine_id="P", request_id="g",
                              remote_block_ids=src, local_block_ids=dst,
                              staged_slots=list(range(start, start + 24)))
        assert stats["plan"] == "staged_both" and stats["label"] == "ucx:cuda_ipc", stats
        check_moved(receiver, src, dst, before)
        sender.send("export", request_id="one", block_ids=[9])
        stats = receiver.send("pull", url=sender.url, engine_id="P", request_id="one",
                              remote_block_ids=[9], local_block_ids=[1])
        assert stats["plan"] == "direct" and stats["num_descriptors"] == 1
    finally:
        sender.close()
        receiver.close()

