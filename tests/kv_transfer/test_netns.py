"""Two "hosts": network namespaces joined by a veth pair, so the KV bytes cross a network
interface. Needs root and `ip`; addresses live only inside the namespaces made here."""

import os
import shutil
import subprocess
import uuid

import pytest

from kv_transfer.nixl_transport import nixl_available
from tests.kv_transfer.peer import block_digests, make_cache
from tests.kv_transfer.peers import Peer

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (ip netns)")

SENDER_IP, RECEIVER_IP = "10.231.0.1", "10.231.0.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def netns_pair():
    tag = uuid.uuid4().hex[:6]
    a, b = f"tdm-a-{tag}", f"tdm-b-{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    ip("netns", "add", a)
    ip("netns", "add", b)
    try:
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", a)
        ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, SENDER_IP), (b, vb, RECEIVER_IP)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, vb
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def rx_bytes(peer: Peer, dev: str) -> int:
    for line in peer.send("netdev")["netdev"].splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == dev:
            return int(rest.split()[0])
    raise AssertionError(f"no {dev} in /proc/net/dev")


@pytest.mark.parametrize("transport", [
    pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
        not nixl_available(), reason="nixl-cu12 is not installed")]),
    "tcp",
])
def test_transfer_crosses_the_veth_link(netns_pair, transport, tmp_path):
    ns_a, ns_b, dev_b = netns_pair
    # Only TCP is allowed so UCX cannot take the shared-memory shortcut between the namespaces.
    env = {"UCX_TLS": "tcp", "UCX_PROTO_INFO": "y"}
    log = str(tmp_path / "ucx.log")
    sender = Peer(transport, "P-ns", netns=ns_a, env=env, host=SENDER_IP, num_blocks=256, seed=1,
                  token="t")
    receiver = Peer(transport, "D-ns", netns=ns_b, env={**env, "UCX_LOG_FILE": log},
                    host=RECEIVER_IP, num_blocks=256, seed=2, token="t", ucx_proto_log=log)
    try:
        blocks = list(range(0, 256, 2))
        sender.send("export", request_id="net-1", block_ids=blocks)
        before = rx_bytes(receiver, dev_b)
        stats = receiver.send("pull", url=sender.url, engine_id=sender.engine_id,
                              request_id="net-1", remote_block_ids=blocks,
                              local_block_ids=list(range(128)))
        assert "error" not in stats, stats
        moved = stats["num_bytes"]
        assert moved == 128 * 4 * 2 * 16 * 3 * 64 * 2
        assert rx_bytes(receiver, dev_b) - before >= moved
        got = receiver.send("digest")["digests"]
        want = block_digests(make_cache(256, seed=1))
        assert [got[i] for i in range(128)] == [want[b] for b in blocks]
        if transport == "nixl":
            assert stats["label"] == "ucx:tcp"
    finally:
        sender.close()
        receiver.close()
