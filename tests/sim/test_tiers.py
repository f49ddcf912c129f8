"""The simulator's KV tiers (issue 41): with them off it gives today's numbers exactly; a host
tier keeps what the device drops; the router's real policy decides which tier hits count; every
tier's budget holds; a reload costs its bytes at the tier's rate before the prefill."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from router.tiered_match import MatchByMedium
from sim.__main__ import main as sim_main
from sim.fleet_cache import FleetCache
from sim.profile import CostProfile
from sim.simulator import Cluster, SimRequest
from sim.sweep import simulate
from sim.workload import Driver, multi_turn

# A device of 60 blocks per worker: the workload below overflows it many times over.
PROFILE = CostProfile(prefill_tokens_per_s=1000.0, prefill_fixed_s=0.01, decode_step_base_s=0.02,
                      decode_step_per_seq_s=0.002, link_bytes_per_s=1e9, link_latency_s=0.003,
                      block_size=16, block_bytes=100_000, num_blocks=60, router_hop_s=0.001,
                      host_blocks=600, disk_blocks=3000)


def sessions():
    return multi_turn(30, turns=4, seed=5, system_tokens=300, user_tokens=30, answer_tokens=16,
                      think_s=2.0)


# What this workload gave before the simulator knew tiers (the code of commit 0c41f1c's sim/,
# run on the same router code): with tiers off every figure is bit-identical. kv_aware's were
# taken again once its workers reported their cache headroom and the policy priced evictions
# (router/eviction_cost.py): the tier code was not touched, the placements changed.
TODAY = {
    "kv_aware": {"requests": 120, "completed": 120, "hit_ratio": 0.16843211065394378,
                 "ttft_s": {"p50": 0.41402513224624293, "p99": 0.945564359763452},
                 "itl_s": {"p50": 0.02200000000000024, "p99": 0.3830000000000009},
                 "goodput_rps": 4.1273617622863, "throughput_rps": 4.162045474574421,
                 "plans": {"disagg": 75, "decode_local": 45}},
    "round_robin": {"requests": 120, "completed": 120, "hit_ratio": 0.014006828328810296,
                    "ttft_s": {"p50": 1.161559472439234, "p99": 3.219490342169813},
                    "itl_s": {"p50": 0.019999999999999574, "p99": 0.03379999999999583},
                    "goodput_rps": 1.7368595471298045, "throughput_rps": 4.253533584807684,
                    "plans": {"disagg": 120}},
}


@pytest.mark.parametrize("policy", sorted(TODAY))
def test_tiers_off_gives_exactly_todays_numbers(policy):
    # The profile's tier fields are set: `off` must ignore them.
    got = simulate(PROFILE, 2, 2, policy, sessions(), rate=3.0, tiers="off")
    assert {k: got[k] for k in TODAY[policy]} == TODAY[policy]
    assert got["hit_ratio_by_tier"]["host"] == got["hit_ratio_by_tier"]["disk"] == 0
    assert got["hit_ratio_by_tier"]["device"] == got["hit_ratio"]


def test_a_host_tier_keeps_the_working_set_the_device_drops():
    runs = {t: simulate(PROFILE, 2, 2, "kv_aware", sessions(), rate=3.0, tiers=t)
            for t in ("off", "host", "unbounded")}
    off, host, ceiling = runs["off"], runs["host"], runs["unbounded"]
    assert host["hit_ratio"] > off["hit_ratio"] + 0.2, (host["hit_ratio"], off["hit_ratio"])
    assert host["hit_ratio_by_tier"]["host"] > 0.2
    assert host["hit_ratio_by_tier"]["disk"] == 0
    assert host["prompt_tokens_recomputed"] < off["prompt_tokens_recomputed"]
    assert host["ttft_s"]["p50"] < off["ttft_s"]["p50"]
    # Nothing beats a device without bound; a host tier of 10x the device comes close here (up
    # to placement: a device that fills up places new work by its headroom, one without bound
    # does not fill, so the two runs' placements differ a little).
    assert host["hit_ratio"] <= ceiling["hit_ratio"] + 0.02
    assert ceiling["hit_ratio_by_tier"]["device"] == ceiling["hit_ratio"]
    assert host["prompt_tokens"] == off["prompt_tokens"] == ceiling["prompt_tokens"]


def test_workers_report_the_profiles_reload_rates_in_their_load():
    c = Cluster(PROFILE, 1, 1, "kv_aware", tiers="host+disk")
    w = c.workers[0]
    w.publish()
    assert w.info.reload_tokens_per_s("host") == pytest.approx(50e9 / 100_000 * 16)
    assert w.info.reload_tokens_per_s("disk") == pytest.approx(5e9 / 100_000 * 16)
    off = Cluster(PROFILE, 1, 1, "kv_aware")
    off.workers[0].publish()
    assert "reload_tokens_per_s" not in off.workers[0].info.load


def _planned_and_held_disk(profile: CostProfile) -> tuple[int, int]:
    c = Cluster(profile, 2, 2, "kv_aware", tiers="host+disk")
    drv = Driver(c, sessions(), rate=3.0)
    c.clock.run()
    planned = sum(r.planned_media.disk for r in drv.requests if r.planned_media is not None)
    held = sum(r.cached_media.disk for r in drv.requests)  # where the prefill ran
    return planned, held


def test_a_disk_slower_than_prefill_is_never_planned_as_a_hit():
    # A small host tier, so blocks reach the disk while their conversations go on.
    small_host = replace(PROFILE, host_blocks=60)
    planned, held = _planned_and_held_disk(small_host)
    assert planned > 0 and held > 0  # a fast disk (5 GB/s: 800k tokens/s) is planned for
    # 300 tokens/s from disk against ~1,000 prefilled: the real policy counts none of it.
    slow = replace(small_host, disk_reload_bytes_per_s=300 / 16 * 100_000)
    planned, held = _planned_and_held_disk(slow)
    assert planned == 0
    assert held > 0  # the disk did hold prompts' blocks (and the engine reloads what it finds)


def test_every_tier_budget_holds_and_a_block_is_in_one_tier():
    profile = replace(PROFILE, host_blocks=90, disk_blocks=150)
    c = Cluster(profile, 2, 2, "kv_aware", tiers="host+disk")
    idx, record = c.index, c.index.record
    caps = {"device": profile.num_blocks, "host": 90, "disk": 150}
    peak = dict.fromkeys(caps, 0)

    def checked(worker_id, block_hashes):
        out = record(worker_id, block_hashes)
        held = {m: idx.replica.held(worker_id, m) for m in caps}
        for m, cap in caps.items():
            assert idx.num_blocks(worker_id, m) == len(held[m]) <= cap, (worker_id, m)
            peak[m] = max(peak[m], len(held[m]))
        assert not (held["device"] & held["host"] or held["device"] & held["disk"]
                    or held["host"] & held["disk"])
        return out

    idx.record = checked
    drv = Driver(c, sessions(), rate=3.0)
    c.clock.run()
    assert all(r.done_at is not None for r in drv.requests)
    assert peak == caps  # every budget was reached, none exceeded


def test_fleet_cache_moves_blocks_down_the_tiers_and_back_up():
    fc = FleetCache(3, host_blocks=2, disk_blocks=2)
    assert fc.record("w", [1, 2, 3, 4, 5]) == 2  # 1, 2 offloaded to the host
    assert fc.record("w", [6, 7]) == 2  # 3, 4 to the host; 1, 2 on to the disk
    assert fc.record("w", [8, 9]) == 2  # 5, 6 to the host; 3, 4 to the disk; 1, 2 gone
    assert fc.match_by_medium([3, 4, 5, 6, 7], ["w"], "exact") == {"w": MatchByMedium(1, 2, 2)}
    assert fc.match_by_medium([1, 2, 3], ["w"]) == {"w": MatchByMedium()}
    fc.record("w", [3, 4])  # reloaded: device blocks again, gone from the disk
    assert fc.replica.held("w", "device") == {9, 3, 4}
    assert fc.replica.held("w", "host") == {7, 8} and fc.replica.held("w", "disk") == {5, 6}
    assert fc.held("w", [3, 4]) == MatchByMedium(2)
    assert fc.num_blocks("w") == 3 and fc.num_blocks("w", "host") == 2
    with pytest.raises(ValueError, match="host_blocks"):
        FleetCache.for_tiers("host", 10, 0, 0)
    with pytest.raises(ValueError, match="unknown tiers"):
        FleetCache.for_tiers("ssd", 10, 10, 10)
    assert FleetCache.for_tiers("unbounded", 10, 5, 5).capacity is None


def test_a_reload_costs_its_bytes_at_the_tiers_rate_before_the_prefill():
    profile = replace(PROFILE, num_blocks=30, host_reload_bytes_per_s=1e8)  # 16k tokens/s
    c = Cluster(profile, 1, 1, "kv_aware", tiers="host")
    prompt = list(range(320))
    hashes = c.hasher(prompt)
    c.index.record("prefill-0", hashes)
    c.index.record("prefill-0", list(range(10**6, 10**6 + 20)))  # blocks 0-9 go to the host
    req = SimRequest(0, prompt, list(range(3)), arrival=1.0)
    c.submit(req)
    c.clock.run()
    assert req.plan == "disagg" and req.cached_media == MatchByMedium(10, 10, 0)
    assert req.planned_media == MatchByMedium(10, 10, 0)
    reload_s = profile.reload_s(10, 0)
    assert reload_s == pytest.approx(10 * 100_000 / 1e8)
    route = profile.lookup_s(20, 2)
    assert (req.first_token_at - req.arrival
            == pytest.approx(route + 2 * profile.router_hop_s + reload_s + profile.prefill_s(0)))
    # Reloaded, they are device blocks again; the host has the oldest other blocks instead.
    assert c.index.held("prefill-0", hashes) == MatchByMedium(20)
    assert c.index.num_blocks("prefill-0", "host") == 10
    assert req.done_at is not None


def test_cli_compares_tiers(tmp_path, monkeypatch):
    import sim.__main__ as cli

    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE.to_json()))
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    assert sim_main(["sweep", "--profile-file", str(path), "--sessions-per-worker", "5",
                     "--sizes", "4", "--ratios", "1:1", "--policies", "kv_aware",
                     "--tiers", "off,host+disk", "--system-tokens", "300"]) == 0
    out = json.loads((tmp_path / "bench" / "results" / "sim_sweep.json").read_text())
    assert [(r["tiers"], r["sessions"]) for r in out["rows"]] == [("off", 20), ("host+disk", 20)]
    for r in out["rows"]:
        assert r["completed"] == r["requests"] == 80
        assert set(r["hit_ratio_by_tier"]) == {"device", "host", "disk"}
        assert r["prompt_tokens_recomputed"] <= r["prompt_tokens"]
    with pytest.raises(SystemExit):
        sim_main(["sweep", "--tiers", "off,ssd"])


def test_an_offload_charged_to_the_step_slows_the_worker_and_none_costs_nothing():
    def mean_ttft(profile):
        c = Cluster(profile, 2, 2, "kv_aware", tiers="host")
        drv = Driver(c, sessions(), rate=3.0)
        c.clock.run()
        return sum(r.first_token_at - r.arrival for r in drv.requests) / len(drv.requests)

    free = mean_ttft(PROFILE)  # the profile's default: the copy is off the step
    assert free == mean_ttft(replace(PROFILE, offload_s_per_block=0.0))
    assert mean_ttft(replace(PROFILE, offload_s_per_block=0.002)) > free * 1.05
