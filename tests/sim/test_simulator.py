"""The simulator: exact arithmetic on an idle cluster, conservation under load, and the real
policies' behaviour (kv_aware's hit ratio over round_robin, conditional disaggregation)."""

from __future__ import annotations

import json

import pytest

from sim.__main__ import main as sim_main
from sim.__main__ import simulate
from sim.profile import CostProfile, load
from sim.simulator import Cluster, SimRequest
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
    assert req.first_token_at - req.arrival == pytest.approx(2 * hop + PROFILE.prefill_s(320))
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
    from sim.simulator import Clock, Host

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
    shared = simulate(replace(PROFILE, host_cores=1, background_cpu_per_token_s=0.002), 2, 1, "random",
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
        runs[policy] = {"prefix_hit_ratio": 0.5, "ttft_s": {"p50": 1.0}, "server_ttft_s": {"p50": 0.02}}
        repeats[policy] = [{"hit_ratio": 0.4, "server_ttft_p50_s": 0.01},
                           {"hit_ratio": 0.6, "server_ttft_p50_s": 0.03}]
    (results / "policies.json").write_text(json.dumps({"sessions": 3, "turns": 2, "runs": runs,
                                                       "repeats": repeats}))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(PROFILE.to_json()))
    assert sim_main(["validate", "--profile-file", str(profile)]) == 0
    out = json.loads((results / "sim_validate.json").read_text())["policies"]
    for policy, cmp in out.items():
        hit, ttft = cmp["hit_ratio"], cmp["ttft_p50_s"]
        assert (hit["real"], hit["real_min"], hit["real_max"]) == pytest.approx((0.5, 0.4, 0.6)), policy
        # The router-side first-token time, not the client's TTFT (1 s here).
        assert ttft["real"] == pytest.approx(0.02) and ttft["error"] == pytest.approx((ttft["sim"] - 0.02) / 0.02)


def test_profile_fit_recovers_the_costs_it_was_measured_with():
    import sys

    from tests.worker.cluster import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from sim_profile import fit

    hop, fixed, rate, latency, bw, step = 0.0005, 0.004, 50_000.0, 0.0015, 5e8, 0.002
    single = []
    for n in (16, 64, 128, 256, 512):
        num_bytes = -(-n // 4) * 2048
        single.append({"plan": "disagg", "num_prompt": n, "num_cached_tokens": 0, "num_output": 8,
                       "prefill_s": 2 * hop + fixed + n / rate, "first_token_s": 0.001 + 2 * hop + fixed + n / rate,
                       "transfer_bytes": num_bytes, "transfer_s": latency + num_bytes / bw,
                       "decode_s": 7 * step})
    batch = [{"num_output": 32, "decode_s": 31 * (step + 3 * 0.0004)}] * 4
    chat = {"requests": 10, "output_tokens": 80, "router_cpu_s": 10 * (0.001 + 3 * hop) + 0.04,
            "client_cpu_s": 0.04, "decode_cpu_s": 70 * step}
    p = fit({"rtt_s": [2 * hop] * 5, "single": single, "batch": batch, "chat": chat, "block_size": 4,
             "num_blocks": 100, "host_cores": 2})
    assert p.router_hop_s == pytest.approx(hop)
    assert p.prefill_tokens_per_s == pytest.approx(rate) and p.prefill_fixed_s == pytest.approx(fixed)
    assert p.link_latency_s == pytest.approx(latency) and p.link_bytes_per_s == pytest.approx(bw)
    assert p.block_bytes == 2048 and p.router_cpu_s == pytest.approx(0.001)
    assert p.decode_step_base_s == pytest.approx(step) and p.decode_step_per_seq_s == pytest.approx(0.0004)
    assert p.background_cpu_per_token_s == pytest.approx(0.08 / 80) and p.worker_io_cpu_per_token_s == 0
    assert p.jitter == pytest.approx(0.0, abs=1e-9) and p.host_cores == 2
