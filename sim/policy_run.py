"""One replay of a trace (sim/traces.py) with one scaling policy (sim/scaling.py) for `python -m sim
autoscale` (sim/autoscale.py compares the policies): its setup (`Setup`: the profile, the trace,
the SLOs, the pools' bounds, the router's settings), the run (`run_policy`: the fleet grows and
shrinks as the policy decides, every `interval_s`) and what it scores (`summarize`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from router.planner import PlannerConfig, PoolBounds
from router.settings import RouterSettings
from sim.fleet import POOLS, Fleet
from sim.profile import CostProfile
from sim.scaling import RouterView, ScalingPolicy
from sim.simulator import Cluster, SimRequest
from sim.traces import Trace
from sim.workload import Driver


@dataclass(frozen=True)
class Setup:
    """What every policy's run in one comparison shares (built once from the flags)."""

    profile: CostProfile
    trace: Trace
    slo_ttft_s: float
    slo_itl_s: float
    percentile: float = 95.0
    bounds: dict[str, tuple[int, int]] = field(
        default_factory=lambda: {"prefill": (1, 32), "decode": (1, 32)})
    queue_target_prefill: float = 2.0
    planner_interval_s: float = 10.0
    # Router settings over the simulator's defaults (RouterSettings field: value).
    router: dict = field(default_factory=dict)

    def router_settings(self) -> RouterSettings:
        p = self.profile
        # Simulated workers pull no prefix from a peer: the policy must not plan such pulls.
        # The SLOs and the profile's decode step line as the router's (kv_aware keeps a decode
        # worker's batch within the ITL SLO on that line until the planner has fitted its own).
        return RouterSettings(**{"block_size": p.block_size, "bytes_per_block": p.block_bytes,
                                 "policy_seed": 0, "peer_pulls": False,
                                 "slo_ttft": self.slo_ttft_s, "slo_itl": self.slo_itl_s,
                                 "slo_percentile": self.percentile,
                                 "planner_decode_step_base_s": p.decode_step_base_s,
                                 "planner_decode_step_per_seq_s": p.decode_step_per_seq_s,
                                 **self.router})

    def planner_config(self) -> PlannerConfig:
        """The planner's configuration: the SLOs, the bounds, a forecast horizon of a start-up
        and a tick, and the profile's costs as its priors (an operator's benchmark of the
        hardware); what it uses is what it measures."""
        p = self.profile
        return PlannerConfig(
            slo_ttft_s=self.slo_ttft_s, slo_itl_s=self.slo_itl_s, percentile=self.percentile,
            prefill=PoolBounds(*self.bounds["prefill"]), decode=PoolBounds(*self.bounds["decode"]),
            horizon_s=p.startup_s + self.planner_interval_s,
            default_prefill_tokens_per_s=p.prefill_tokens_per_s,
            decode_step_base_s=p.decode_step_base_s, decode_step_per_seq_s=p.decode_step_per_seq_s)

    def queue_targets(self) -> dict[str, float]:
        p, cfg = self.profile, self.planner_config()
        batch = 1 + (self.slo_itl_s - p.decode_step_base_s) / p.decode_step_per_seq_s
        return {"prefill": self.queue_target_prefill,
                "decode": max(1.0, math.floor(batch * cfg.max_utilization))}


def run_policy(setup: Setup, policy: ScalingPolicy, initial: dict[str, int]) -> dict:
    """Replays the trace with `policy` scaling a fleet that starts at `initial`."""
    t0 = time.perf_counter()
    trace = setup.trace
    cluster = Cluster(setup.profile, initial["prefill"], initial["decode"], "kv_aware",
                      settings=setup.router_settings())
    driver = Driver(cluster, trace.sessions, arrivals=trace.arrivals, keep_prompts=False)
    fleet = Fleet(cluster, setup.profile.startup_s)
    view = RouterView(cluster, driver.requests)
    total = sum(len(s.turns) for s in trace.sessions)
    clock = cluster.clock
    events = dict.fromkeys(POOLS, 0)
    timeline: list[dict] = []

    def second() -> None:
        view.sample()
        fleet.reap()
        if view.completed < total:
            clock.after(1.0, second)

    def tick() -> None:
        view.update(clock.now)
        sizes = {pool: fleet.size(pool) for pool in POOLS}
        want = policy.decide(clock.now, view, sizes)
        for pool in POOLS:
            if want[pool] != sizes[pool]:
                events[pool] += 1
                fleet.scale(pool, want[pool])
        t = clock.now - trace.start_s  # the timeline: a point a minute, from the trace's start
        if t >= 0 and (not timeline or t - timeline[-1]["t"] >= 60):
            timeline.append({"t": round(t), **{pool: fleet.size(pool) for pool in POOLS}})
        if view.completed < total:
            clock.after(policy.interval_s, tick)

    clock.at(0.0, second)
    clock.at(policy.interval_s, tick)
    clock.run()
    scored = [r for r in driver.requests if r.arrival >= trace.start_s]
    end = max([trace.end_s, *(r.done_at for r in scored if r.done_at is not None)])
    seconds = fleet.worker_seconds(trace.start_s, end)
    out = {"policy": policy.name, **summarize(scored, setup.slo_ttft_s, setup.slo_itl_s),
           "worker_hours": sum(seconds.values()) / 3600,
           "worker_hours_by_pool": {pool: s / 3600 for pool, s in seconds.items()},
           "initial": dict(initial), "scale_events": sum(events.values()),
           "scale_events_by_pool": events, "workers_started": fleet.started,
           "workers_scaled_down": fleet.drained, "end_s": end, "timeline": timeline,
           "sim_wall_s": time.perf_counter() - t0}
    out["slo_met_per_worker_hour"] = out["slo_met"] / out["worker_hours"]
    return out


def summarize(requests: list[SimRequest], slo_ttft_s: float, slo_itl_s: float) -> dict:
    ttfts, itls, met = [], [], 0
    for r in requests:
        if r.done_at is None:
            continue
        ttft = r.first_token_at - r.arrival
        n = len(r.token_times)
        itl = (r.token_times[-1] - r.token_times[0]) / (n - 1) if n >= 2 else 0.0
        ttfts.append(ttft)
        itls.append(itl)
        met += ttft <= slo_ttft_s and itl <= slo_itl_s
    return {"requests": len(requests), "completed": len(ttfts), "slo_met": met,
            "attainment": met / len(requests) if requests else 0.0,
            "ttft_s": _quantiles(ttfts), "itl_s": _quantiles(itls)}


def _quantiles(values: list[float]) -> dict:
    v = sorted(values)
    return {f"p{q}": v[min(len(v) - 1, int(q / 100 * len(v)))] if v else None
            for q in (50, 95, 99)}
