"""The simulator: exact arithmetic on an idle cluster, conservation under load, and the real
policies' behaviour (kv_aware's hit ratio over round_robin, conditional disaggregation)."""

from __future__ import annotations

import json
import math

import pytest

from sim.__main__ import main as sim_main
from sim.profile import CostProfile, load
from sim.simulator import Cluster, SimRequest
from sim.sweep import simulate
from sim.workload import Driver, SimSession, multi_turn

PROFILE = CostProfile(prefill_tokens_per_s=1000.0, prefill_fixed_s=0.01, decode_step_base_s=0.02,
                      decode_step_per_seq_s=0.002, link_bytes_per_s=1e9, link_latency_s=0.003,
                      block_size=16, block_bytes=100_000, num_blocks=4096, router_hop_s=0.001)


def test_one_request_on_an_idle_cluster_costs_exactly_the_profile():
    c = Cluster(PROFILE, 1, 1, "kv_aware")
    req = SimRequest(0, list(range(320)), list(range(5)), arrival=1.0)
    c.submit(req)
    c.clock.run()
    assert req.plan == "disagg"
    hop = PROFILE.router_hop_s
    route = PROFILE.lookup_s(20, 2)  # hashing 20 blocks, the index lookup over 2 workers
    assert route == pytest.approx(20 * 0.5e-6 + 10e-6 + 2 * math.log2(21) * 0.14e-6)
    assert (req.first_token_at - req.arrival
            == pytest.approx(route + 2 * hop + PROFILE.prefill_s(320)))
    # Then the pull of 20 blocks, the decode call, and 4 decode steps of batch 1.
    itl = [b - a for a, b in zip(req.token_times, req.token_times[1:], strict=False)]
    assert itl[0] == pytest.approx(2 * hop + PROFILE.transfer_s(20) + PROFILE.decode_step_s(1))
    assert itl[1:] == pytest.approx([PROFILE.decode_step_s(1)] * 3)
    assert len(req.token_times) == 5 and req.done_at is not None
    # The router learned the link from that pull (router/dispatch.py's own code).
    d = next(w for w in c.workers if w.info.role == "decode")
    assert d.info.transfer_bytes_per_s == pytest.approx(20 * 100_000 / PROFILE.transfer_s(20))


def test_everything_completes_and_nothing_is_left_inflight():
    sessions = multi_turn(60, turns=3, seed=3, system_tokens=100, user_tokens=20, answer_tokens=10)
    c = Cluster(PROFILE, 2, 2, "kv_aware")
    drv = Driver(c, sessions, rate=2.0)
    c.clock.run()
    assert len(drv.requests) == 180
    for r in drv.requests:
        assert r.done_at is not None and len(r.token_times) == len(r.answer)
        assert r.arrival < r.first_token_at <= r.done_at
    assert all(w.info.inflight == 0 and w.info.inflight_tokens == 0 for w in c.workers)
    assert sum(c.plans.values()) == 180


def test_kv_aware_beats_round_robin_and_uses_conditional_disaggregation():
    sessions = multi_turn(40, turns=4, seed=1, system_tokens=300, user_tokens=30, answer_tokens=16)
    kv = simulate(PROFILE, 4, 2, "kv_aware", sessions, concurrency=8)
    rr = simulate(PROFILE, 4, 2, "round_robin", sessions, concurrency=8)
    assert kv["hit_ratio"] > rr["hit_ratio"] + 0.2, (kv["hit_ratio"], rr["hit_ratio"])
    assert kv["plans"].get("decode_local", 0) > 0  # later turns: D holds the conversation
    assert rr["plans"] == {"disagg": 160}
    assert kv["ttft_s"]["p50"] < rr["ttft_s"]["p50"]


def test_closed_loop_keeps_n_sessions_in_flight():
    sessions = [SimSession(list(range(50)), [(list(range(100, 110)), 4)] * 2) for _ in range(6)]
    c = Cluster(PROFILE, 1, 1, "kv_aware")
    drv = Driver(c, sessions, concurrency=2)
    c.clock.run()
    starts = sorted(r.arrival for r in drv.requests if r.prompt[:50] == list(range(50)))
    assert len(drv.requests) == 12 and starts[0] == starts[1] == 0.0 and starts[2] > 0.0


def test_profile_file_and_cli(tmp_path, monkeypatch):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(PROFILE.to_json()))
    assert load(path) == PROFILE
    path.write_text(json.dumps({**PROFILE.to_json(), "tflops": 1}))
    with pytest.raises(ValueError, match="unknown profile fields"):
        load(path)
    path.write_text(json.dumps(PROFILE.to_json()))
    import sim.__main__ as cli

    monkeypatch.setattr(cli, "ROOT", tmp_path)
    assert sim_main(["sweep", "--profile-file", str(path), "--sessions", "50", "--sizes", "4",
                     "--ratios", "1:1"]) == 0
    rows = json.loads((tmp_path / "bench" / "results" / "sim_sweep.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["kv_aware", "round_robin", "random"]
    assert all(r["completed"] == r["requests"] == 200 for r in rows)


def test_shared_host_is_processor_sharing():
    from sim.host import Clock, Host

    def finish_times(cores: float, works: list[float]) -> list[float]:
        clock = Clock()
        host = Host(clock, cores)
        done: list[float] = []
        for w in works:
            host.run(w, lambda: done.append(clock.now))
        clock.run()
        return done

    assert finish_times(1, [1.0, 1.0]) == pytest.approx([2.0, 2.0])  # two jobs share one core
    assert finish_times(2, [1.0, 1.0]) == pytest.approx([1.0, 1.0])  # one core each
    assert finish_times(1, [1.0, 2.0]) == pytest.approx([2.0, 3.0])  # alone after the first ends
    assert finish_times(2, [1.0, 1.0, 1.0, 1.0]) == pytest.approx([2.0] * 4)


def test_one_machine_profile_slows_a_loaded_cluster_and_random_is_reproducible():
    from dataclasses import replace

    sessions = multi_turn(30, turns=3, seed=2, system_tokens=200, user_tokens=20, answer_tokens=16)
    own = simulate(PROFILE, 2, 1, "random", sessions, concurrency=8)
    shared = simulate(replace(PROFILE, host_cores=1, client_cpu_per_token_s=0.002,
                              router_relay_cpu_per_token_s=0.001), 2, 1, "random",
                      sessions, concurrency=8)
    assert shared["ttft_s"]["p50"] > own["ttft_s"]["p50"]
    assert simulate(PROFILE, 2, 1, "random", sessions, concurrency=8) == own  # seeded policy


def test_validate_compares_with_the_mean_of_real_repeats(tmp_path, monkeypatch):
    import sim.__main__ as cli

    monkeypatch.setattr(cli, "ROOT", tmp_path)
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    runs, repeats = {}, {}
    for policy in ("kv_aware", "round_robin", "random"):
        runs[policy] = {"prefix_hit_ratio": 0.5, "ttft_s": {"p50": 1.0},
                        "server_ttft_s": {"p50": 0.02}}
        repeats[policy] = [{"hit_ratio": 0.4, "server_ttft_p50_s": 0.01},
                           {"hit_ratio": 0.6, "server_ttft_p50_s": 0.03}]
    (results / "policies.json").write_text(json.dumps({"sessions": 3, "turns": 2, "runs": runs,
                                                       "repeats": repeats, "concurrency": 1}))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(PROFILE.to_json()))
    assert sim_main(["validate", "--profile-file", str(profile)]) == 0
    saved = json.loads((results / "sim_validate.json").read_text())
    assert saved["concurrency"] == 1  # replayed with as many sessions in flight as the real run
    out = saved["policies"]
    for policy, cmp in out.items():
        hit, ttft = cmp["hit_ratio"], cmp["ttft_p50_s"]
        assert ((hit["real"], hit["real_min"], hit["real_max"])
                == pytest.approx((0.5, 0.4, 0.6))), policy
        # The router-side first-token time, not the client's TTFT (1 s here).
        assert (ttft["real"] == pytest.approx(0.02)
                and ttft["error"] == pytest.approx((ttft["sim"] - 0.02) / 0.02))


def test_profile_fit_recovers_the_costs_it_was_measured_with():
    import sys
    from dataclasses import replace

    from testing.processes import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from sim_fit import fit, simulated_cpu

    hop, fixed, rate, latency, bw, step = 0.0005, 0.004, 50_000.0, 0.0015, 5e8, 0.002
    router_cpu, chat_fixed, local_fixed, chat_step = 0.0015, 0.006, 0.008, 0.003
    single = []
    for n in (16, 64, 128, 256, 512):
        num_bytes = -(-n // 4) * 2048
        single.append({"plan": "disagg", "num_prompt": n, "num_cached_tokens": 0, "num_output": 8,
                       "prefill_s": 2 * hop + fixed + n / rate,
                       "first_token_s": 0.001 + 2 * hop + fixed + n / rate,
                       "transfer_bytes": num_bytes, "transfer_s": latency + num_bytes / bw,
                       "decode_s": 7 * step})
    batch = [{"num_output": 32, "decode_s": 31 * (step + 3 * 0.0004)}] * 4
    # Chat one at a time: disaggregated turns (a cached prefix makes the fixed part larger) and
    # local ones (their first token from the decode worker).
    seq = []
    for n, cached in ((120, 0), (200, 100), (300, 180), (260, 240)):
        leg = 2 * hop + chat_fixed + (n - cached) / rate
        seq.append({"plan": "disagg", "num_prompt": n, "num_cached_tokens": cached, "num_output": 8,
                    "prefill_s": leg, "first_token_s": router_cpu + leg, "decode_s": 7 * chat_step})
        seq.append({"plan": "decode_local", "num_prompt": n, "num_cached_tokens": cached,
                    "num_output": 8, "prefill_s": 0.0, "decode_s": 0.02,
                    "first_token_s": router_cpu + 2 * hop + local_fixed + (n - cached) / rate})
    sessions = multi_turn(4, turns=3, seed=3, system_tokens=40, user_tokens=10, answer_tokens=8)
    num_tokens = sum(n for s in sessions for _, n in s.turns)
    chat = {"requests": 12, "output_tokens": num_tokens, "router_cpu_s": 0.08,
            "prefill_cpu_s": 0.12, "decode_cpu_s": 0.2, "client_cpu_s": 0.04,
            "sessions": [[s.system, [[u, n] for u, n in s.turns]] for s in sessions]}
    p = fit({"rtt_s": [2 * hop] * 5, "single": single, "batch": batch, "chat_sequential": seq,
             "chat": chat, "block_size": 4, "num_blocks": 100, "host_cores": 2})
    assert p.router_hop_s == pytest.approx(hop)
    assert (p.prefill_tokens_per_s == pytest.approx(rate)
            and p.prefill_fixed_s == pytest.approx(chat_fixed))
    assert (p.local_prefill_fixed_s == pytest.approx(local_fixed)
            and p.router_cpu_s == pytest.approx(router_cpu))
    assert p.link_latency_s == pytest.approx(latency) and p.link_bytes_per_s == pytest.approx(bw)
    assert p.block_bytes == 2048
    assert (p.decode_step_base_s == pytest.approx(chat_step)
            and p.decode_step_per_seq_s == pytest.approx(0.0004))
    assert p.client_cpu_per_token_s == pytest.approx(0.04 / num_tokens)
    assert p.jitter == pytest.approx(0.0, abs=1e-9) and p.host_cores == 2
    # The CPU the latencies miss is added until the same chat, simulated, costs each process
    # what it was measured to; without it, every process would cost less.
    got = simulated_cpu(p, sessions)
    assert got == pytest.approx({"router": 0.08, "prefill": 0.12, "decode": 0.2}, rel=0.03)
    assert p.router_relay_cpu_per_token_s > 0 and p.prefill_io_cpu_s > 0 and p.decode_io_cpu_s > 0
    bare = simulated_cpu(replace(p, router_relay_cpu_per_token_s=0, prefill_io_cpu_s=0,
                                 decode_io_cpu_s=0), sessions)
    assert all(bare[k] < 0.9 * got[k] for k in got), bare


def test_local_prefill_costs_its_own_fixed_part():
    from dataclasses import replace

    profile = replace(PROFILE, local_prefill_fixed_s=0.05)
    c = Cluster(profile, 0, 1, "kv_aware")  # no prefill worker: the decode worker prefills
    req = SimRequest(0, list(range(320)), list(range(3)), arrival=0.0)
    c.submit(req)
    c.clock.run()
    assert req.plan == "decode_local"
    assert req.first_token_at == pytest.approx(PROFILE.lookup_s(20, 1)
                                               + 2 * PROFILE.router_hop_s + 0.05
                                               + 320 / PROFILE.prefill_tokens_per_s)


def test_on_a_shared_host_tokens_pass_the_router_and_the_client_before_the_next_turn():
    from dataclasses import replace

    # Cores to spare: no sharing, so every cost is exact.
    profile = replace(PROFILE, host_cores=64, router_cpu_s=0.004,
                      router_relay_cpu_per_token_s=0.003, client_cpu_per_token_s=0.002,
                      decode_io_cpu_s=0.03, prefill_io_cpu_s=0.02)
    c = Cluster(profile, 1, 1, "round_robin")
    req = SimRequest(0, list(range(320)), list(range(5)), arrival=0.0)
    c.submit(req)
    c.clock.run()
    hop = PROFILE.router_hop_s
    # The router's own work, then the prefill leg (its hops are the router's work too).
    route = 0.004 + PROFILE.lookup_s(20, 2)
    assert req.first_token_at == pytest.approx(route + 2 * hop + PROFILE.prefill_s(320))
    # The last token: a hop to the router, relayed, read by the client.
    assert req.done_at - req.token_times[-1] == pytest.approx(hop + 0.003 + 0.002)
    busy = {name: t.busy_s for name, t in c.threads().items()}
    assert busy["prefill-0"] == pytest.approx(PROFILE.prefill_s(320) + 0.02)
    assert busy["decode-0"] == pytest.approx(4 * PROFILE.decode_step_s(1) + 0.03)
    assert busy["router"] == pytest.approx(route + 3 * hop + 5 * 0.003)
    assert busy["client"] == pytest.approx(5 * 0.002)


def test_repeated_measurements_pool_into_one():
    import sys

    from testing.processes import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from sim_fit import pool

    def run(cpu: float, cores: float) -> dict:
        return {"rtt_s": [cpu], "single": [{"x": cpu}], "batch": [],
                "chat_sequential": [{"y": cpu}], "host_cores": cores, "block_size": 4,
                "chat": {"requests": 12, "output_tokens": 90, "router_cpu_s": cpu, "wall_s": 1.0,
                         "sessions": [1]}}

    m = pool([run(0.1, 1.5), run(0.3, 1.7), run(0.2, 1.9)])
    assert m["rtt_s"] == [0.1, 0.3, 0.2] and m["single"] == [{"x": 0.1}, {"x": 0.3}, {"x": 0.2}]
    assert m["host_cores"] == 1.7 and m["block_size"] == 4
    assert m["chat"]["router_cpu_s"] == pytest.approx(0.2) and m["chat"]["requests"] == 12
    assert m["chat"]["sessions"] == [1]


def test_host_capacity_is_at_most_the_core_count():
    import sys

    from testing.processes import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from sim_profile import host_capacity

    assert 0 < host_capacity(1, loops=200_000) <= 1.0
    assert 0 < host_capacity(2, loops=200_000) <= 2.0


def test_fleet_cache_is_the_router_replica_with_each_workers_capacity():
    from sim.fleet_cache import FleetCache

    cache = FleetCache(capacity_blocks=4)
    cache.record("w", [1, 2, 3])
    cache.record("v", [1, 2])
    assert cache.match([1, 2, 3, 9], ["w", "v", "ghost"], "exact") == {"w": 3, "v": 2, "ghost": 0}
    cache.record("w", [1, 7, 8])  # 1 stored again (most recent), 2 and 3 are the oldest: 2 goes
    assert cache.match([1, 2, 3], ["w"], "exact") == {"w": 1}
    assert cache.match([1, 7, 8], ["w"], "gallop") == {"w": 3}
    assert cache.replica.num_blocks("w") == 4 and cache.replica.num_blocks("v") == 2


def test_long_contexts_and_large_fleets_cost_the_router_what_the_index_bench_measured():
    from dataclasses import replace

    assert PROFILE.lookup_s(6250, 1024) > 20 * PROFILE.lookup_s(128, 32)
    sessions = multi_turn(8, turns=2, seed=1, system_tokens=20_000, shared_prefixes=2,
                          user_tokens=50, answer_tokens=4)
    assert len({tuple(s.system) for s in sessions}) <= 2  # agents sharing their context
    profile = replace(PROFILE, num_blocks=20_000)
    aware = simulate(profile, 16, 48, "kv_aware", sessions, rate=2.0)
    blind = simulate(profile, 16, 48, "round_robin", sessions, rate=2.0)
    assert aware["completed"] == blind["completed"] == 16
    # Second turns and shared contexts hit where the index sends them, rarely by chance.
    assert aware["hit_ratio"] > 0.4 and aware["hit_ratio"] > 2 * blind["hit_ratio"]
