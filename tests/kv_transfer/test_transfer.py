"""Real transfers between two processes, for every transport: bit-exact blocks, leases freed
on notification or expiry, a killed receiver leaking nothing, bad layouts and ids refused."""

import time

import pytest

from kv_transfer.nixl_transport import nixl_available
from tests.kv_transfer.peer import block_digests, make_cache
from tests.kv_transfer.peers import Peer, wait_for

TRANSPORTS = [
    pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
        not nixl_available(), reason="nixl-cu12 is not installed")]),
    "tcp",
]
TOKEN = "s3cret"


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def pair(transport):
    """One sender and one receiver per transport, shared by the tests (distinct request ids)."""
    sender = Peer(transport, "P0", num_blocks=64, seed=1, token=TOKEN, lease_seconds=30)
    receiver = Peer(transport, "D0", num_blocks=48, seed=2, token=TOKEN)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_blocks_move_bit_exact_and_sender_frees_on_notification(pair):
    sender, receiver = pair
    src_blocks = [5, 6, 7, 30, 2, 63]
    dst_blocks = [10, 11, 12, 0, 47, 20]
    before = receiver.send("digest")["digests"]
    params = sender.send("export", request_id="req-1", block_ids=src_blocks)
    assert params["remote_block_ids"] == src_blocks and params["lease_expires_at"] > time.time()
    assert sender.send("state")["leases"] == 1
    stats = receiver.send("pull", url=sender.url, engine_id="P0", request_id="req-1",
                          remote_block_ids=src_blocks, local_block_ids=dst_blocks)
    assert "error" not in stats, stats
    assert stats["num_bytes"] == len(src_blocks) * 4 * 2 * 16 * 3 * 64 * 2
    got = receiver.send("digest")["digests"]
    src_expected = block_digests(make_cache(64, seed=1))
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert got[d] == src_expected[s]
    untouched = set(range(48)) - set(dst_blocks)
    assert all(got[b] == before[b] for b in untouched)
    state = wait_for(lambda: (s := sender.send("state"))["leases"] == 0 and s)
    assert "req-1" in state["released"] and state["expired"] == 0
    assert state["notified"] == state["granted"] - state["leases"]


def test_partial_pull_of_missing_blocks_only(pair):
    sender, receiver = pair
    params = sender.send("export", request_id="req-2", block_ids=[1, 2, 3, 4])
    # The receiver already holds the first two blocks: it pulls the last two only.
    stats = receiver.send("pull", url=sender.url, engine_id=sender.engine_id, request_id="req-2",
                          remote_block_ids=params["remote_block_ids"][2:], local_block_ids=[8, 9])
    assert stats["num_bytes"] == 2 * 4 * 2 * 16 * 3 * 64 * 2
    got = receiver.send("digest")["digests"]
    expected = block_digests(make_cache(64, seed=1))
    assert got[8] == expected[3] and got[9] == expected[4]
    assert wait_for(lambda: sender.send("state")["leases"] == 0)


def test_lease_expiry_frees_blocks_when_receiver_never_pulls(transport):
    sender = Peer(transport, "P1", num_blocks=16, seed=1, lease_seconds=30)
    try:
        sender.send("export", request_id="never", block_ids=[1, 2], lease_seconds=0.3)
        sender.send("export", request_id="later", block_ids=[3], lease_seconds=30)
        state = wait_for(lambda: (s := sender.send("state"))["expired"] == 1 and s, timeout=5)
        assert state["released"] == ["never"] and state["leases"] == 1
        assert sender.send("cancel", request_id="later")["cancelled"]
        assert sender.send("state")["leases"] == 0
    finally:
        sender.close()


def test_killed_receiver_leaks_nothing(transport):
    sender = Peer(transport, "P2", num_blocks=512, seed=1, lease_seconds=1.0)
    receiver = Peer(transport, "D2", num_blocks=512, seed=2)
    try:
        blocks = list(range(512))
        sender.send("export", request_id="doomed", block_ids=blocks, lease_seconds=1.0)
        receiver.send_nowait("pull", url=sender.url, engine_id=sender.engine_id,
                             request_id="doomed", remote_block_ids=blocks, local_block_ids=blocks)
        time.sleep(0.05)
        receiver.kill()
        state = wait_for(lambda: (s := sender.send("state"))["leases"] == 0 and s, timeout=10)
        assert state["released"] == ["doomed"]
        # The sender is still healthy: a new receiver can pull.
        fresh = Peer(transport, "D3", num_blocks=8, seed=3)
        try:
            sender.send("export", request_id="next", block_ids=[7])
            stats = fresh.send("pull", url=sender.url, engine_id=sender.engine_id,
                               request_id="next", remote_block_ids=[7], local_block_ids=[0])
            assert "error" not in stats, stats
            assert fresh.send("digest")["digests"][0] == block_digests(make_cache(512, seed=1))[7]
        finally:
            fresh.close()
    finally:
        sender.close()


def test_layout_mismatch_is_refused_with_what_differs(transport):
    sender = Peer(transport, "P4", num_blocks=16, seed=1, block_size=16)
    receiver = Peer(transport, "D4", num_blocks=16, seed=2, block_size=32, model_id="other")
    try:
        sender.send("export", request_id="r", block_ids=[1])
        out = receiver.send("pull", url=sender.url, engine_id=sender.engine_id, request_id="r",
                            remote_block_ids=[1], local_block_ids=[1])
        assert out["error"] == "LayoutMismatch"
        assert "block_size: 32 here vs 16 at the peer" in out["message"]
        assert "model_id: 'other' here vs 'test-model' at the peer" in out["message"]
        digests = receiver.send("digest")["digests"]
        assert digests == block_digests(make_cache(16, seed=2, block_size=32))
    finally:
        sender.close()
        receiver.close()


def test_out_of_range_block_ids_are_refused(pair):
    sender, receiver = pair
    before = receiver.send("digest")["digests"]
    sender.send("export", request_id="r", block_ids=[1, 2])
    out = receiver.send("pull", url=sender.url, engine_id=sender.engine_id, request_id="r",
                        remote_block_ids=[1, 64], local_block_ids=[0, 1])
    assert (out["error"] == "BlockRangeError"
            and "remote block ids out of range [0, 64): [64]" in out["message"])
    out = receiver.send("pull", url=sender.url, engine_id=sender.engine_id, request_id="r",
                        remote_block_ids=[1, 2], local_block_ids=[0, 48])
    assert (out["error"] == "BlockRangeError"
            and "local block ids out of range [0, 48)" in out["message"])
    assert receiver.send("digest")["digests"] == before
    out = sender.send("export", request_id="bad", block_ids=[-1])
    assert out["error"] == "BlockRangeError"
    assert sender.send("cancel", request_id="r")["cancelled"]


def test_metadata_endpoint_requires_the_internal_token(pair, transport):
    import httpx

    sender, _ = pair
    assert httpx.get(f"{sender.url}/kv/metadata").status_code == 401
    assert httpx.get(f"{sender.url}/kv/metadata",
                     headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = httpx.get(f"{sender.url}/kv/metadata", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["layout"]["num_blocks"] == 64
    wrong = Peer(transport, "D9", num_blocks=8, seed=2, token="wrong")
    try:
        out = wrong.send("pull", url=sender.url, engine_id=sender.engine_id, request_id="x",
                         remote_block_ids=[1], local_block_ids=[1])
        assert out["error"] == "TransferError" and "HTTP 401" in out["message"]
    finally:
        wrong.close()


def test_tcp_fp8_packing_halves_bytes_within_e4m3_error():
    import torch

    sender = Peer("tcp", "P5", num_blocks=16, seed=1)
    receiver = Peer("tcp", "D5", num_blocks=16, seed=2, fp8=True)
    try:
        sender.send("export", request_id="f", block_ids=[3, 4])
        stats = receiver.send("pull", url=sender.url, engine_id=sender.engine_id, request_id="f",
                              remote_block_ids=[3, 4], local_block_ids=[0, 1])
        full = 2 * 4 * 2 * 16 * 3 * 64 * 2
        assert stats["label"] == "tcp+fp8" and stats["num_bytes"] == full // 2 + 2 * 4 * 2 * 4
        got = torch.tensor(receiver.send("blocks", block_ids=[0, 1])["values"])
        want = make_cache(16, seed=1)[[3, 4]].float()
        err = (got - want).abs().amax(dim=(3, 4, 5))  # per run
        assert (err <= want.abs().amax(dim=(3, 4, 5)) * 2**-4 + 1e-3).all()
        assert not torch.equal(got, want)  # it really went through fp8
        assert wait_for(lambda: sender.send("state")["leases"] == 0)
    finally:
        sender.close()
        receiver.close()
