"""`python -m sim autoscale`: one trace (sim/traces.py) replayed over the router's real policy
with the fleet scaled by each of:

- `planner`: the SLO planner (router/planner.py), its real code, on what a router measures;
- `static_peak`: a fixed fleet sized for the trace's busiest minute, `static_mean` for its mean,
  both by the planner's own capacity model at the demand measured during the planner's run
  (its prompt and output token rates: no forecast, headroom, backlog or piled-up streams);
- `queue_depth`: Kubernetes' HPA on each pool's requests in flight per replica, as KEDA setups
  scale on the router's queue (targets: the decode batch within the ITL SLO at the planner's
  utilization, from the profile; `queue_target_prefill` prefills in flight).

A worker asked for serves the profile's `startup_s` later; one scaled down drains. For each
policy: attainment (the share of requests whose first token came within the TTFT SLO and whose
mean inter-token latency was within the ITL SLO), worker-hours (every worker from when it was
asked for until it was gone), requests and scale events (one policy's run: sim/policy_run.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

from router.planner import Planner
from sim.fleet import POOLS
from sim.policy_run import Setup, run_policy
from sim.profile import load
from sim.scaling import PlannerPolicy, QueueDepth, Static
from sim.traces import TRACES, TraceShape, make_trace

POLICIES = ("planner", "static_peak", "static_mean", "queue_depth")
H200 = Path(__file__).resolve().parent / "profiles" / "h200-llama3-8b.json"
# The router's near-tie band in these runs. At the default (2 ms) kv_aware sends every new
# session to the decode worker that already holds its system prompt (its KV transfer is ~6 ms
# shorter), however many streams run there: a decode worker added mid-run gets no traffic.
# Within 20 ms, plans are ties broken by load.
NEAR_TIE_S = 0.02


def static_sizes(history: list[tuple[float, dict]], bounds: dict[str, tuple[int, int]],
                 start_s: float, window_s: float = 60.0) -> dict[str, dict[str, int]]:
    """static_peak and static_mean from the planner's need at the load measured in its run
    (from `start_s`): the busiest `window_s` (its mean need) and the mean over the trace."""
    out: dict[str, dict[str, int]] = {"static_peak": {}, "static_mean": {}}
    for pool in POOLS:
        series = [(t, needs[pool][1]) for t, needs in history if t >= start_s]
        peak = 0.0
        for t, _ in series:
            inside = [n for u, n in series if t - window_s < u <= t]
            peak = max(peak, sum(inside) / len(inside))
        mean = sum(n for _, n in series) / max(len(series), 1)
        lo, hi = bounds[pool]
        out["static_peak"][pool] = min(max(math.ceil(peak - 1e-9), lo, 1), hi)
        out["static_mean"][pool] = min(max(math.ceil(mean - 1e-9), lo, 1), hi)
    return out


def compare(setup: Setup, policies: tuple[str, ...] = POLICIES, log=None) -> dict:
    """Every policy over the same trace (the planner first: the static fleets are sized from
    its run). Returns the JSON `python -m sim autoscale` prints."""
    runs: dict[str, dict] = {}
    low = {pool: max(setup.bounds[pool][0], 1) for pool in POOLS}
    planner = PlannerPolicy(Planner(setup.planner_config(), low["prefill"], low["decode"]),
                            setup.planner_interval_s)
    runs["planner"] = run_policy(setup, planner, low)
    sizes = static_sizes(planner.history, setup.bounds, setup.trace.start_s)
    for name in policies:
        if name == "planner":
            continue
        if name in sizes:
            runs[name] = run_policy(setup, Static(name, sizes[name]), sizes[name])
        elif name == "queue_depth":
            runs[name] = run_policy(setup, QueueDepth(setup.queue_targets(), setup.bounds), low)
        else:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        if log:
            log(runs[name])
    if log:
        log(runs["planner"])
    rows = [runs[name] for name in POLICIES if name in runs and name in policies]
    return {"profile": setup.profile.to_json(), "trace": setup.trace.summary(),
            "slo": {"ttft_s": setup.slo_ttft_s, "itl_s": setup.slo_itl_s,
                    "percentile": setup.percentile}, "router": setup.router,
            "planner_config": asdict(setup.planner_config()),
            "queue_targets": setup.queue_targets(), "static_sizes": sizes,
            "policies": rows, "goals": goals(runs, setup.percentile)}


def goals(runs: dict[str, dict], percentile: float) -> dict:
    """The issue's done-when, on this run."""
    p = runs["planner"]
    out = {"attainment_met": p["attainment"] >= percentile / 100}
    if "static_peak" in runs:
        ratio = p["worker_hours"] / runs["static_peak"]["worker_hours"]
        out |= {"hours_vs_static_peak": ratio, "hours_met": ratio <= 0.7}
    if "queue_depth" in runs:
        ratio = p["slo_met_per_worker_hour"] / runs["queue_depth"]["slo_met_per_worker_hour"]
        out |= {"per_hour_vs_queue_depth": ratio, "beats_queue_depth": ratio > 1}
    return out


def add_flags(ap: argparse.ArgumentParser) -> None:
    """`python -m sim autoscale`'s flags (sim/__main__.py)."""
    shape = TraceShape()
    ap.add_argument("--profile-file", default=str(H200),
                    help="JSON cost profile (default: the H200 Llama-3-8B one)")
    ap.add_argument("--trace", choices=TRACES, default="diurnal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds to the first token")
    ap.add_argument("--slo-itl", type=float, default=0.06,
                    help="seconds between tokens (a request's mean)")
    ap.add_argument("--percentile", type=float, default=95.0,
                    help="share of requests each SLO must hold for")
    ap.add_argument("--policies", type=lambda v: tuple(v.split(",")), default=POLICIES)
    ap.add_argument("--duration-s", type=float, default=shape.duration_s)
    ap.add_argument("--warmup-s", type=float, default=shape.warmup_s,
                    help="the opening load before the trace, not scored")
    ap.add_argument("--peak-sessions-per-s", type=float, default=shape.peak_sessions_per_s)
    ap.add_argument("--kv-blocks-scale", type=float, default=1.0,
                    help="scale the profile's KV blocks per worker (0.5: half)")
    ap.add_argument("--startup-s", type=float, default=None,
                    help="a new worker's start-up (default: the profile's startup_s)")
    for pool in POOLS:
        ap.add_argument(f"--min-{pool}", type=int, default=1)
        ap.add_argument(f"--max-{pool}", type=int, default=32)
    ap.add_argument("--queue-target-prefill", type=float, default=2.0,
                    help="queue_depth: prefills in flight per prefill worker")
    ap.add_argument("--near-tie-s", type=float, default=NEAR_TIE_S,
                    help="the router's --near-tie-s in every run")
    ap.add_argument("--out", default="sim_autoscale.json", help="file name under bench/results/")


def setup_from(args: argparse.Namespace) -> Setup:
    profile = load(args.profile_file)
    changes = {"num_blocks": max(1, round(profile.num_blocks * args.kv_blocks_scale))}
    if args.startup_s is not None:
        changes["startup_s"] = args.startup_s
    shape = replace(TraceShape(), duration_s=args.duration_s, warmup_s=args.warmup_s,
                    peak_sessions_per_s=args.peak_sessions_per_s)
    return Setup(replace(profile, **changes), make_trace(args.trace, args.seed, shape),
                 args.slo_ttft, args.slo_itl, args.percentile,
                 bounds={pool: (getattr(args, f"min_{pool}"), getattr(args, f"max_{pool}"))
                         for pool in POOLS},
                 queue_target_prefill=args.queue_target_prefill,
                 router={"near_tie_s": args.near_tie_s})


def autoscale(args: argparse.Namespace) -> dict:
    setup = setup_from(args)

    def log(row: dict) -> None:
        print(json.dumps({k: row[k] for k in ("policy", "attainment", "worker_hours",
                                              "requests", "scale_events", "sim_wall_s")}),
              file=sys.stderr, flush=True)

    return {"seed": args.seed, **compare(setup, args.policies, log)}
