"""What lets the simulator run a 1,024-worker agentic sweep: the exact speed-ups change no
figure (bulk token draws, sessions drawn as they start, prompts kept past their hashed blocks
only, the store order of each worker's tiers), and the explicit coarsenings of
sim/coarsening.py conserve the profile's token figures and stay close to the exact run."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import replace

import pytest

from router.tiered_match import MatchByMedium
from sim.coarsening import CandidateSample, coarsen
from sim.fleet_cache import StoreOrder
from sim.profile import CostProfile
from sim.simulator import Cluster
from sim.sweep import simulate
from sim.workload import Driver, LazySessions, TokenDraws, multi_turn

PROFILE = CostProfile(prefill_tokens_per_s=1000.0, prefill_fixed_s=0.01, decode_step_base_s=0.02,
                      decode_step_per_seq_s=0.002, link_bytes_per_s=1e9, link_latency_s=0.003,
                      block_size=16, block_bytes=100_000, num_blocks=240, router_hop_s=0.001,
                      host_blocks=2400, disk_blocks=6000)
WORKLOAD = {"turns": 4, "seed": 5, "system_tokens": 600, "user_tokens": 30, "answer_tokens": 16,
            "think_s": 2.0}


@pytest.mark.parametrize("vocab", [1, 3, 1000, 49152, 65536, (1 << 32) - 5])
@pytest.mark.parametrize("n", [0, 5, 300, 20_000])
def test_bulk_draws_are_the_loops_numbers_and_leave_the_generator_where_it_would(vocab, n):
    loop, bulk = random.Random(11), random.Random(11)
    assert TokenDraws(bulk, vocab)(n) == [loop.randrange(vocab) for _ in range(n)]
    assert bulk.getstate() == loop.getstate()


def test_lazy_sessions_are_multi_turns_drawn_one_at_a_time():
    eager = multi_turn(12, **WORKLOAD)
    lazy = LazySessions(12, **WORKLOAD)
    assert len(lazy) == 12
    assert [lazy[i] for i in range(12)] == eager
    assert lazy[3] == eager[3]  # an earlier one: drawn again from the seed
    with pytest.raises(IndexError):
        lazy[12]


@pytest.mark.parametrize("tiers", ["off", "host+disk"])
def test_prompts_kept_past_their_hashed_blocks_only_give_the_same_run(tiers):
    def run(keep_prompts: bool, sessions) -> list[tuple]:
        c = Cluster(PROFILE, 2, 2, "kv_aware", tiers=tiers)
        drv = Driver(c, sessions, rate=3.0, keep_prompts=keep_prompts)
        c.clock.run()
        return [(r.num_prompt_tokens, r.num_cached_tokens, r.plan, r.first_token_at, r.done_at)
                for r in drv.requests]

    full = run(True, multi_turn(30, **WORKLOAD))
    assert full == run(False, LazySessions(30, **WORKLOAD))
    assert sum(cached for _, cached, *_ in full) > 0


def test_store_order_evicts_as_an_ordered_dict_moved_to_the_end():
    rng = random.Random(3)
    ours, ref = StoreOrder(), OrderedDict()
    for _ in range(400):
        batch = rng.sample(range(300), rng.randrange(1, 40))
        ours.store(batch)
        for h in batch:
            ref[h] = None
            ref.move_to_end(h)
        if rng.random() < 0.3:
            gone = rng.sample(range(300), 20)
            assert sorted(ours.discard(gone)) == sorted(h for h in gone if h in ref)
            for h in gone:
                ref.pop(h, None)
        n = max(0, len(ref) - 120)
        assert ours.pop_oldest(n) == [ref.popitem(last=False)[0] for _ in range(n)]
        assert set(ours.last) == set(ref) and len(ours) == len(ref)


def test_a_workers_holdings_are_the_replicas_exact_search():
    c = Cluster(PROFILE, 2, 2, "kv_aware", tiers="host+disk")
    Driver(c, multi_turn(30, **WORKLOAD), rate=3.0)
    c.clock.run()
    idx = c.index
    for w in c.workers:
        wid = w.info.worker_id
        for medium in ("device", "host", "disk"):
            held = idx.replica.held(wid, medium)
            assert idx.num_blocks(wid, medium) == len(held)
            probe = sorted(held)[:50] + [1, 2, 3]
            assert idx.held(wid, probe) == idx.match_by_medium(probe, [wid], "exact")[wid]
    assert idx.held("nobody", [1]) == MatchByMedium()


def test_coarse_blocks_conserve_tokens_bytes_and_costs():
    p = replace(PROFILE, offload_s_per_block=0.001)
    q = coarsen(p, 128)
    f = 128 // 16
    assert q.block_size == 128 and q.block_bytes == p.block_bytes * f
    assert q.num_blocks * q.block_size == p.num_blocks * p.block_size
    assert q.host_blocks * q.block_size == p.host_blocks * p.block_size
    assert q.disk_blocks * q.block_size == p.disk_blocks * p.block_size
    assert q.reload_tokens_per_s("host") == p.reload_tokens_per_s("host")
    assert q.reload_s(1, 1) == pytest.approx(p.reload_s(f, f))
    assert q.transfer_s(1) == pytest.approx(p.transfer_s(f))
    assert q.offload_s_per_block == pytest.approx(p.offload_s_per_block * f)
    with pytest.raises(ValueError, match="multiple"):
        coarsen(p, 100)
    # The router's hashing and lookup are priced at the profile's own block size.
    exact, coarse = Cluster(p, 1, 1), Cluster(p, 1, 1, block_tokens=128)
    assert coarse.profile == q and coarse.settings.block_size == 128
    assert coarse._lookup_profile == exact.profile


def test_candidates_are_every_matched_worker_and_k_of_each_role():
    c = Cluster(PROFILE, 6, 10, "kv_aware")
    live = [w.info for w in c.workers]
    matches = dict.fromkeys((w.worker_id for w in live), 0) | {"decode-7": 3, "prefill-5": 1}
    sample = CandidateSample(2, seed=1)
    got = sample(live, matches)
    ids = [w.worker_id for w in got]
    assert "decode-7" in ids and "prefill-5" in ids
    roles = [i.split("-")[0] for i in ids]
    assert roles.count("prefill") == roles.count("decode") == 3
    assert ids == [w.worker_id for w in live if w.worker_id in ids]  # in the fleet's order
    assert [w.worker_id for w in CandidateSample(2, seed=1)(live, matches)] == ids
    assert sample(live, dict.fromkeys(matches, 0)) != got
    with pytest.raises(ValueError):
        CandidateSample(0)


def test_coarsenings_that_change_nothing_give_the_exact_run():
    sessions = multi_turn(30, **WORKLOAD)
    exact = simulate(PROFILE, 2, 3, "kv_aware", sessions, rate=3.0, tiers="host")
    # k at least every pool's size: the policy sees every worker, in the same order
    assert simulate(PROFILE, 2, 3, "kv_aware", sessions, rate=3.0, tiers="host",
                    route_candidates=3) == exact
    assert simulate(PROFILE, 2, 3, "kv_aware", sessions, rate=3.0, tiers="host",
                    block_tokens=16) == exact


def test_coarse_blocks_stay_close_to_exact_ones():
    # ~4,000-token contexts in 64-token blocks, a host tier that holds the working set: what
    # moves is each turn's last partial block, recomputed (at most 48 tokens more a turn).
    profile = replace(PROFILE, prefill_tokens_per_s=20_000.0, num_blocks=1000, host_blocks=10_000)
    sessions = multi_turn(40, seed=5, turns=4, system_tokens=4000, user_tokens=40,
                          answer_tokens=16, think_s=2.0)
    exact = simulate(profile, 2, 4, "kv_aware", sessions, rate=2.0, tiers="host")
    coarse = simulate(profile, 2, 4, "kv_aware", sessions, rate=2.0, tiers="host",
                      block_tokens=64)
    assert exact["prompt_tokens"] == coarse["prompt_tokens"]
    turns = exact["requests"]
    assert 0 <= exact["hit_ratio"] - coarse["hit_ratio"] <= 48 * turns / exact["prompt_tokens"]
    assert coarse["ttft_s"]["p99"] == pytest.approx(exact["ttft_s"]["p99"], rel=0.05)
    assert coarse["slo_attainment"] == pytest.approx(exact["slo_attainment"], abs=0.02)
