"""The simulator's sweep (`python -m sim sweep`, sim/__main__.py): one simulated setting run and
summarized (`simulate`), and every (size, P:D ratio, policy, KV tiers) setting of a sweep in turn
(`sweep`)."""

from __future__ import annotations

import json
import resource
import sys
import time

from sim.profile import calibrated, load
from sim.simulator import Cluster, SimRequest
from sim.workload import Driver, LazySessions, SimSession


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))]


def summarize(requests: list[SimRequest], cluster: Cluster, slo_ttft_s: float,
              slo_itl_s: float) -> dict:
    done = [r for r in requests if r.done_at is not None]
    ttft = [r.first_token_at - r.arrival for r in done]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    span = max(r.done_at for r in done) - min(r.arrival for r in done) if done else 0.0
    good = [r for r in done if r.first_token_at - r.arrival <= slo_ttft_s and
            (len(r.token_times) < 2
             or (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) <= slo_itl_s)]
    num_prompt = max(sum(r.num_prompt_tokens for r in done), 1)
    by_tier = dict.fromkeys(("device", "host", "disk"), 0)  # cached tokens, where they were
    for r in done:
        if r.cached_media is not None:
            for medium in by_tier:
                by_tier[medium] += getattr(r.cached_media, medium) * cluster.profile.block_size
    return {
        "requests": len(requests), "completed": len(done),
        "hit_ratio": sum(r.num_cached_tokens for r in done) / num_prompt,
        "hit_ratio_by_tier": {m: n / num_prompt for m, n in by_tier.items()},
        "prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "prompt_tokens_recomputed": sum(r.num_prompt_tokens - r.num_cached_tokens for r in done),
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "itl_s": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
        "goodput_rps": len(good) / span if span else 0.0,
        # the share of requests within the SLO (goodput's ratio to the whole run's span swings
        # with the one session that ends last)
        "slo_attainment": len(good) / len(done) if done else 0.0,
        "throughput_rps": len(done) / span if span else 0.0, "plans": dict(cluster.plans),
    }


def simulate(profile, num_prefill: int, num_decode: int, policy: str, sessions: list[SimSession], *,
             rate: float | None = None, concurrency: int | None = None, slo=(1.0, 0.1),
             tiers: str = "off", block_tokens: int | None = None,
             route_candidates: int | None = None, peer_pulls: bool = False) -> dict:
    cluster = Cluster(profile, num_prefill, num_decode, policy, tiers=tiers,
                      block_tokens=block_tokens, route_candidates=route_candidates,
                      peer_pulls=peer_pulls)
    # Only the prompts' lengths are summarized: let each go once done (30k-token contexts).
    driver = Driver(cluster, sessions, rate=rate, concurrency=concurrency, keep_prompts=False)
    cluster.clock.run()
    return {**summarize(driver.requests, cluster, *slo), "peer_pulls": peer_pulls,
            "pulls": cluster.pulls.num_pulls, "pulled_tokens": cluster.pulls.num_pulled_tokens,
            "pulled_tokens_by_link": dict(cluster.pulls.pulled_by_link)}


def sweep(args) -> dict:
    """Every (size, ratio, policy, tiers) row of a sweep, and what it ran on."""
    profile = load(args.profile_file) if args.profile_file else calibrated(args.profile)
    rows, sessions, made_for = [], None, None
    for size in args.sizes:
        num_sessions = (round(args.sessions_per_worker * size) if args.sessions_per_worker
                        else args.sessions)
        if made_for != num_sessions:  # drawn as each run starts them, never all at once
            sessions = LazySessions(num_sessions, turns=args.turns, seed=args.seed,
                                    system_tokens=args.system_tokens,
                                    user_tokens=args.user_tokens,
                                    answer_tokens=args.answer_tokens, think_s=args.think_s,
                                    shared_prefixes=args.shared_prefixes)
            made_for = num_sessions
        for ratio in args.ratios:
            p_share, d_share = (int(x) for x in ratio.split(":"))
            num_p = max(1, round(size * p_share / (p_share + d_share)))
            num_d = max(1, size - num_p)
            rate = args.sessions_per_s_per_worker * size
            for policy in args.policies:
                for tiers in args.tiers:
                    t0, cpu0 = time.perf_counter(), time.process_time()
                    s = simulate(profile, num_p, num_d, policy, sessions, rate=rate,
                                 slo=(args.slo_ttft, args.slo_itl), tiers=tiers,
                                 block_tokens=args.block_tokens,
                                 route_candidates=args.route_candidates,
                                 peer_pulls=args.peer_pulls)
                    row = {"workers": size, "prefill": num_p, "decode": num_d, "policy": policy,
                           "tiers": tiers, "sessions": num_sessions, "session_rate": rate, **s,
                           "sim_wall_s": time.perf_counter() - t0,
                           "sim_cpu_s": time.process_time() - cpu0,
                           "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
                    rows.append(row)
                    print(json.dumps({k: row[k] for k in SHOWN}), file=sys.stderr, flush=True)
    return {"profile": profile.to_json(), "sessions": args.sessions,
            "sessions_per_worker": args.sessions_per_worker, "turns": args.turns,
            "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
            "answer_tokens": args.answer_tokens, "think_s": args.think_s,
            "sessions_per_s_per_worker": args.sessions_per_s_per_worker,
            "shared_prefixes": args.shared_prefixes,
            "block_tokens": args.block_tokens, "route_candidates": args.route_candidates,
            "slo": {"ttft_s": args.slo_ttft, "itl_s": args.slo_itl}, "rows": rows}


SHOWN = ("workers", "prefill", "decode", "policy", "tiers", "peer_pulls", "hit_ratio",
         "hit_ratio_by_tier", "prompt_tokens_recomputed", "pulled_tokens", "ttft_s", "itl_s",
         "goodput_rps", "sim_wall_s", "sim_cpu_s")
