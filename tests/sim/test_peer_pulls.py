"""Peer prefix pulls in the simulator (sim/peer_pulls.py): the real policy plans a pull when the
holder is busy, the computing worker waits for it at its link's rate (by locality class), finds
the blocks cached, and the router's fabric learns that pair's bandwidth from it."""

from __future__ import annotations

import pytest

from common.locality import link_class
from sim.profile import CostProfile
from sim.simulator import Cluster, SimRequest

PROFILE = CostProfile(prefill_tokens_per_s=1000.0, prefill_fixed_s=0.01, decode_step_base_s=0.02,
                      decode_step_per_seq_s=0.002, link_bytes_per_s=1e9, link_latency_s=0.003,
                      block_size=16, block_bytes=1_000_000, num_blocks=4096, router_hop_s=0.001,
                      workers_per_node=1, nodes_per_rack=2, same_rack_bytes_per_s=4e9,
                      cross_rack_bytes_per_s=0.5e9)


def test_localities_fill_nodes_then_racks():
    assert [PROFILE.locality(i) for i in range(3)] == ["z/r0/n0", "z/r0/n1", "z/r1/n2"]
    assert PROFILE.pull_s(10, "same_rack") == pytest.approx(0.003 + 10e6 / 4e9)
    assert PROFILE.pull_s(10, "cross_zone") == pytest.approx(0.003 + 10e6 / 0.5e9)


@pytest.mark.parametrize("pulls", [True, False])
def test_a_busy_holder_s_prefix_is_pulled_by_the_worker_that_computes(pulls):
    c = Cluster(PROFILE, 0, 0, "kv_aware", num_colocated=2, peer_pulls=pulls)
    holder, other = c.workers
    assert link_class(holder.info.locality, other.info.locality) == "same_rack"
    context = list(range(1600))  # 100 blocks
    first = SimRequest(0, context + [7], [1, 2], arrival=0.0)
    c.submit(first)
    c.clock.run()
    # The holder is now backed up; the fork goes to the other worker.
    holder.info.load = {**holder.info.load, "waiting_tokens": 50_000}
    c._sample = None
    fork = SimRequest(1, context + [8, 9, 10], [3, 4], arrival=c.clock.now + 1)
    holder.publish = lambda: None  # keep the backlog the router sees
    c.submit(fork)
    c.clock.run()
    assert fork.done_at is not None
    if pulls:
        assert c.pulls.num_pulled_tokens == 100 * 16
        assert c.pulls.pulled_by_link == {"same_rack": 1600}
        assert fork.num_cached_tokens >= 1600  # found on the computing worker
        # Learned: the link's rate, give or take the fixed cost the fabric assumed (5 ms, the
        # router's --transfer-fixed-s, against the link's 3 ms) until small pulls measure it.
        link = c.policy.fabric.link(holder.info.locality, other.info.locality)
        assert link.bytes_per_s == pytest.approx(4e9, rel=0.15)
    else:
        assert c.pulls.num_pulled_tokens == 0 and fork.num_cached_tokens == 0
