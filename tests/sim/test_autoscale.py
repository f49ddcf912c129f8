"""`python -m sim autoscale` (sim/autoscale.py, sim/policy_run.py, sim/fleet.py, sim/scaling.py,
sim/traces.py): workers that start late and drain, what the simulated router measures, the HPA
baseline's arithmetic, the traces' shapes, and a small comparison end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sim.__main__ import main as sim_main
from sim.autoscale import compare, static_sizes
from sim.fleet import Fleet
from sim.policy_run import Setup
from sim.profile import CostProfile
from sim.scaling import QueueDepth, RouterView
from sim.simulator import Cluster, SimRequest
from sim.traces import TraceShape, make_trace
from sim.workload import Driver, SimSession

GPU = CostProfile(prefill_tokens_per_s=15000.0, prefill_fixed_s=0.02, decode_step_base_s=0.008,
                  decode_step_per_seq_s=0.0027, link_bytes_per_s=50e9, link_latency_s=0.0005,
                  block_size=16, block_bytes=1 << 20, num_blocks=20000, router_hop_s=0.0005,
                  startup_s=30.0)
SMALL = TraceShape(duration_s=480.0, warmup_s=60.0, peak_sessions_per_s=1.0, turns=2,
                   system_tokens=500, user_tokens=60, answer_tokens=40, think_s=2.0,
                   burst_s=60.0, burst_context_tokens=3000, burst_answer_tokens=20)


def test_a_worker_serves_startup_s_after_it_is_asked_for_and_drains_before_it_is_gone():
    c = Cluster(GPU, 1, 1, "kv_aware")
    fleet = Fleet(c, GPU.startup_s)
    fleet.scale("decode", 2)
    assert fleet.size("decode") == 2 and len(fleet.live("decode")) == 1
    c.clock.run(until=29.9)
    assert len(fleet.live("decode")) == 1
    c.clock.run(until=30.0)
    new = next(w for w in fleet.live("decode") if w.info.worker_id == "decode-1")
    # A long request on the new worker, then the pool scaled down under it.
    req = SimRequest(0, list(range(64)), list(range(400)), arrival=31.0)
    c.clock.at(31.0, new.prefill_locally, req)
    new.info.inflight += 1
    c.clock.run(until=32.0)
    down = c.clock.now
    fleet.scale("decode", 1)
    assert [w.info.worker_id for w in fleet.draining] == ["decode-0"]  # the idle one goes
    fleet.reap()
    assert fleet.gone_at == {"decode-0": down}  # idle: gone at once
    fleet.scale("decode", 0)  # never the last worker that decodes
    assert len(fleet.live("decode")) == 1
    # Asked for and cancelled before it started: it never serves, its time still counts.
    asked = c.clock.now
    fleet.scale("prefill", 2)
    c.clock.run(until=40.0)
    cancelled = c.clock.now
    fleet.scale("prefill", 1)
    c.clock.run(until=80.0)
    assert [w.info.worker_id for w in fleet.live("prefill")] == ["prefill-0"]
    assert fleet.gone_at["prefill-1"] == cancelled
    c.clock.run()
    assert req.done_at is not None and len(req.token_times) == 400
    seconds = fleet.worker_seconds(0.0, 100.0)
    assert seconds["prefill"] == pytest.approx(100.0 + cancelled - asked)
    assert seconds["decode"] == pytest.approx(down + 100.0 - 0.0)


def test_a_draining_worker_is_gone_once_its_requests_are_done():
    c = Cluster(GPU, 1, 2, "kv_aware")
    fleet = Fleet(c, 0.0)
    d0, d1 = fleet.live("decode")
    reqs = [SimRequest(i, list(range(64)), list(range(200)), arrival=0.0) for i in range(3)]
    for w, r in zip((d0, d1, d1), reqs, strict=True):  # decode-0 has the fewest in flight
        w.info.inflight += 1  # as routing counts it (the worker counts it off when done)
        w.prefill_locally(r)
    c.clock.run(until=0.5)
    fleet.scale("decode", 1)
    assert fleet.draining == [d0] and fleet.live("decode") == [d1]
    while reqs[0].done_at is None:
        fleet.reap()
        assert "decode-0" not in fleet.gone_at  # busy: not gone
        c.clock.run(until=c.clock.now + 0.25)
    fleet.reap()
    assert fleet.gone_at["decode-0"] == pytest.approx(c.clock.now) and not fleet.draining
    c.clock.run()
    assert all(len(r.token_times) == 200 for r in reqs)  # nothing failed on the way down


def test_router_view_measures_the_uncached_tokens_routed_and_the_tokens_streamed():
    c = Cluster(GPU, 1, 1, "kv_aware")
    # One stream of 2,000 tokens (~16 s at 8 ms a step), then a short second turn.
    sessions = [SimSession(list(range(1000, 1320)),
                           [(list(range(5000, 5050)), 2000), (list(range(6000, 6020)), 20)])]
    driver = Driver(c, sessions, arrivals=[0.0])
    view = RouterView(c, driver.requests)
    for t in range(30):
        c.clock.at(t + 0.5, view.sample)  # the streams and batch, each second
    c.clock.run(until=10.0)
    view.update(10.0)
    m, (first,) = view.measurements, driver.requests
    assert m.uncached_prompt_tokens_per_s == pytest.approx(370 / 10.0)
    assert m.prompts_per_s == pytest.approx(0.1) and m.streams_decoding == 1
    streamed = len(first.token_times) / 10.0
    assert m.output_tokens_per_s == pytest.approx(streamed, rel=0.05)  # Little's law
    assert view.step[0] == 1.0 and view.step[1] == pytest.approx(
        (first.token_times[-1] - first.token_times[0]) / (len(first.token_times) - 1))
    c.clock.run()
    view.update(c.clock.now)
    second = driver.requests[1]
    assert second.planned_cached_blocks > 0  # the conversation so far was cached
    assert view.completed == 2 and m.num_prefill == 1 and m.num_decode == 1
    # The router's own learning (router/dispatch.py): fixed costs included, below the rate.
    assert 0.3 * GPU.prefill_tokens_per_s < view.measurements.prefill_tokens_per_s \
        < GPU.prefill_tokens_per_s
    assert view.measurements.uncached_prompt_tokens_per_s == pytest.approx(
        (second.num_prompt_tokens - second.planned_cached_blocks * 16) / (c.clock.now - 10.0))


class _View:
    def __init__(self, queue: dict[str, int], live: dict[str, int]) -> None:
        self._queue, self._live = queue, live

    def queue(self, pool: str) -> int:
        return self._queue[pool]

    def live(self, pool: str) -> list:
        return [None] * self._live[pool]


def test_queue_depth_is_the_hpa_algorithm():
    q = QueueDepth({"prefill": 2.0, "decode": 10.0}, {"prefill": (1, 8), "decode": (1, 4)})
    sizes = {"prefill": 3, "decode": 2}
    # 10 in flight on 3 prefill workers at 2 each: 5; 21 on 2 decode at 10: within 10%.
    assert q.decide(0, _View({"prefill": 10, "decode": 21}, sizes), sizes) == {
        "prefill": 5, "decode": 2}
    # Load gone: down only to the highest recommendation of the last 300 s.
    sizes = {"prefill": 5, "decode": 2}
    assert q.decide(100, _View({"prefill": 0, "decode": 0}, sizes), sizes)["prefill"] == 5
    assert q.decide(301, _View({"prefill": 0, "decode": 0}, sizes), sizes)["prefill"] == 1
    big = q.decide(400, _View({"prefill": 0, "decode": 500}, sizes), sizes)
    assert big["decode"] == 4  # bounded


def test_traces_have_their_shapes_and_are_seeded():
    ramp = make_trace("ramp", 0, SMALL)
    start, d = SMALL.warmup_s, SMALL.duration_s
    third = [sum(start + i * d / 3 <= t < start + (i + 1) * d / 3 for t in ramp.arrivals)
             for i in range(3)]
    assert third[1] > third[0] and third[1] > third[2]  # up, held, down
    assert make_trace("ramp", 0, SMALL).arrivals == ramp.arrivals
    assert make_trace("ramp", 1, SMALL).arrivals != ramp.arrivals
    burst = make_trace("burst", 0, SMALL)
    at = start + SMALL.burst_at * d
    long = [t for t, s in zip(burst.arrivals, burst.sessions, strict=True)
            if len(s.system) > 1000]
    assert long and all(at <= t < at + SMALL.burst_s for t in long)
    diurnal = make_trace("diurnal", 0, SMALL)
    assert any(t < start for t in diurnal.arrivals)  # the warm-up is part of the trace
    with pytest.raises(ValueError, match="unknown trace"):
        make_trace("sawtooth", 0, SMALL)


def test_static_sizes_are_the_busiest_minute_and_the_mean():
    history = [(t, {"prefill": (9.0, 1.0 + (t >= 100)), "decode": (9.0, 2.5)})
               for t in range(0, 200, 10)]
    sizes = static_sizes(history, {"prefill": (1, 8), "decode": (1, 2)}, 0.0)
    assert sizes["static_peak"] == {"prefill": 2, "decode": 2}  # the bound holds
    assert sizes["static_mean"] == {"prefill": 2, "decode": 2}
    assert static_sizes(history, {"prefill": (1, 8), "decode": (1, 8)},
                        0.0)["static_mean"]["prefill"] == 2  # mean 1.5, rounded up


def test_a_small_comparison_end_to_end():
    # Prefill at a third of the GPU's rate: the burst of long prompts needs more than one.
    setup = Setup(replace(GPU, prefill_tokens_per_s=5000.0), make_trace("burst", 0, SMALL),
                  2.0, 0.06,
                  bounds={"prefill": (1, 6), "decode": (1, 6)}, router={"near_tie_s": 0.02})
    out = compare(setup)
    rows = {r["policy"]: r for r in out["policies"]}
    assert list(rows) == ["planner", "static_peak", "static_mean", "queue_depth"]
    for r in rows.values():
        assert r["completed"] == r["requests"] > 100  # every request finishes, none fails
        assert 0 <= r["attainment"] <= 1 and r["worker_hours"] > 0
        assert r["slo_met_per_worker_hour"] == pytest.approx(r["slo_met"] / r["worker_hours"])
    assert rows["planner"]["scale_events"] > 0 and rows["static_peak"]["scale_events"] == 0
    assert rows["planner"]["workers_started"]["prefill"] > 0  # the burst scaled prefill up
    assert rows["planner"]["workers_scaled_down"]["prefill"] > 0  # and it came back down
    peak, mean = out["static_sizes"]["static_peak"], out["static_sizes"]["static_mean"]
    assert all(peak[p] >= mean[p] for p in peak)
    # A static fleet's hours are its size over the scored span.
    span = rows["static_peak"]["end_s"] - setup.trace.start_s
    assert rows["static_peak"]["worker_hours"] == pytest.approx(sum(peak.values()) * span / 3600)
    assert set(out["goals"]) >= {"attainment_met", "hours_vs_static_peak", "beats_queue_depth"}


def test_cli_prints_one_json_with_the_policies(tmp_path, monkeypatch, capsys):
    import sim.__main__ as cli

    profile = tmp_path / "gpu.json"
    profile.write_text(json.dumps(replace(GPU, startup_s=20.0).to_json()))
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    assert sim_main(["autoscale", "--profile-file", str(profile), "--trace", "ramp",
                     "--seed", "3", "--slo-ttft", "2", "--slo-itl", "0.06", "--duration-s",
                     "120", "--warmup-s", "30", "--peak-sessions-per-s", "0.5", "--policies",
                     "planner,static_peak", "--out", "as.json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["seed"] == 3 and printed["profile"]["startup_s"] == 20.0
    assert [p["policy"] for p in printed["policies"]] == ["planner", "static_peak"]
    for p in printed["policies"]:
        assert {"policy", "attainment", "worker_hours", "requests", "scale_events"} <= set(p)
    written = json.loads((tmp_path / "bench" / "results" / "as.json").read_text())
    assert set(written.pop("provenance")) >= {"commit", "machine", "command"}  # bench/provenance
    assert written == printed
