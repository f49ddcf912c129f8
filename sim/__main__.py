"""Size a cluster before buying it: simulated multi-turn traffic over the router's real policy.

    python -m sim sweep [--profile smollm2-cpu | --profile-file gpu.json] [--sessions 10000]
    python -m sim validate [--profile-file my-profile.json] [--real bench/results/policies.json]
                             # against a real bench/policies.py run on this machine

`sweep` runs, per policy (kv_aware, round_robin, random), cluster size (8 to 128 workers by
default, up to 1,024) and P:D ratio, the same seeded sessions at an arrival rate that scales with
the cluster, and reports hit ratio, TTFT and ITL p50/p99 and goodput under the SLO; the router's
hashing and index lookup cost what bench/index.py measured. JSON: bench/results/sim_sweep.json.
The fleet sweep (1,024 workers, 100k-token agentic contexts on an assumed H200 profile):

    python -m sim sweep --profile-file sim/profiles/h200-llama3-8b.json --sizes 128,512,1024 \
        --ratios 1:3 --sessions 1500 --turns 2 --system-tokens 100000 --shared-prefixes 96 \
        --user-tokens 400 --answer-tokens 150 --sessions-per-s-per-worker 0.01 \
        --policies kv_aware,round_robin --slo-ttft 5 --slo-itl 0.1 --out sim_fleet.json
With `--tiers off,host,host+disk,unbounded` each row runs once per KV-tier setting (capacities
and reload rates from the profile; unbounded: a device cache without bound, the ceiling), with
the hit ratio by tier and the prompt tokens recomputed; bench/sim_tiers.py is the agentic
sweep (sessions scaled with the fleet: --sessions-per-worker). Fleets too large to simulate
exactly run coarse: `--block-tokens N` (the cache in blocks of N tokens) and `--route-candidates
K` (the policy sees the workers with a match and K others of each role), sim/coarsening.py.
`autoscale` replays one trace (ramp, burst or diurnal: sim/traces.py) with the fleet scaled by
the SLO planner (router/planner.py, its real code), by a static fleet sized for the peak and for
the mean, and by queue depth (HPA/KEDA); it prints one JSON whose `policies` list has each one's
attainment, worker-hours, requests and scale events (sim/autoscale.py):

    python -m sim autoscale --profile-file sim/profiles/h200-llama3-8b.json --trace burst \
        --seed 0 --slo-ttft 2 --slo-itl 0.06 --out sim_autoscale_burst.json
`validate` replays bench/policies.py's workload (same seed, the tiny-random tokenizer's lengths,
2 prefill + 1 decode, as many sessions in flight) at the tiny-cpu profile (or one given with
--profile-file) and compares with the real run. JSON: bench/results/sim_validate.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from sim.fleet_cache import TIERS
from sim.profile import calibrated, load
from sim.simulator import Cluster, SimRequest
from sim.workload import Driver, LazySessions, SimSession, from_chat

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("kv_aware", "round_robin", "random")


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


def cmd_sweep(args) -> int:
    _write(args.out, sweep(args))
    return 0


def cmd_validate(args) -> int:
    """bench/policies.py's run, replayed: same sessions (lengths from the real tokenizer and chat
    template), same topology and concurrency, tiny-cpu costs."""
    from common.tokenizer import Tokenizer
    from engine.model_store import resolve_model
    from loadgen import workload

    real_path = Path(args.real) if args.real else ROOT / "bench" / "results" / "policies.json"
    if not real_path.exists():
        print(f"no real run at {real_path}: run `.venv/bin/python bench/policies.py` first",
              file=sys.stderr)
        return 2
    real = json.loads(real_path.read_text())
    tok = Tokenizer(resolve_model("tiny-random"))
    text_sessions = workload.multi_turn(real["sessions"], turns=real["turns"], seed=0,
                                        system_words=30, user_words=8, max_tokens=8)
    sessions = from_chat(text_sessions, tok)
    profile = load(args.profile_file) if args.profile_file else calibrated("tiny-cpu")
    concurrency = real.get("concurrency", 4)  # runs from before --concurrency had 4 in flight
    out = {"profile": profile.to_json(), "real": str(real_path), "concurrency": concurrency,
           "policies": {}}
    for policy in POLICIES:
        sim = simulate(profile, 2, 1, policy, sessions, concurrency=concurrency)
        got = real["runs"][policy]
        # The router's own first-token time: the client's TTFT also waits for the first token
        # that has text, which tiny-random's byte tokens often lack (not a routing cost).
        runs = real.get("repeats", {}).get(policy) or [{
            "hit_ratio": got["prefix_hit_ratio"],
            "server_ttft_p50_s": (got.get("server_ttft_s") or {}).get("p50")}]
        cmp = {"hit_ratio": (sim["hit_ratio"], [r["hit_ratio"] for r in runs]),
               "ttft_p50_s": (sim["ttft_s"]["p50"], [r["server_ttft_p50_s"] for r in runs])}
        # Against the mean of the real runs, with their spread: one run on this machine moves
        # by tens of percent from the next.
        out["policies"][policy] = {k: _versus(a, b) for k, (a, b) in cmp.items()}
    _write(args.out, out)
    print(json.dumps(out["policies"], indent=2))
    return 0


def cmd_autoscale(args) -> int:
    from sim.autoscale import autoscale

    out = autoscale(args)
    _write(args.out, out)
    print(json.dumps(out, indent=2))
    return 0


def _versus(sim: float, real: list[float]) -> dict:
    mean = sum(real) / len(real)
    return {"sim": sim, "real": mean, "real_min": min(real), "real_max": max(real),
            "error": (sim - mean) / mean}


def _write(name: str, data: dict) -> None:
    path = ROOT / "bench" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _tiers(text: str) -> list[str]:
    tiers = text.split(",")
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown tiers {bad}; choose from {', '.join(TIERS)}")
    return tiers


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sw = sub.add_parser("sweep", help="policies x cluster sizes x P:D ratios")
    sw.add_argument("--profile", default="smollm2-cpu")
    sw.add_argument("--profile-file", default=None,
                    help="JSON cost profile (e.g. measured on a GPU)")
    sw.add_argument("--sessions", type=int, default=10_000)
    sw.add_argument("--turns", type=int, default=4)
    sw.add_argument("--system-tokens", type=int, default=400)
    sw.add_argument("--user-tokens", type=int, default=60)
    sw.add_argument("--answer-tokens", type=int, default=48)
    sw.add_argument("--think-s", type=float, default=5.0)
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 128])
    sw.add_argument("--ratios", type=lambda s: s.split(","), default=["1:1", "1:3"])
    sw.add_argument("--sessions-per-s-per-worker", type=float, default=0.05)
    sw.add_argument("--slo-ttft", type=float, default=2.0)
    sw.add_argument("--slo-itl", type=float, default=0.25)
    sw.add_argument("--shared-prefixes", type=int, default=None,
                    help="draw system prompts from this many shared ones (agentic, long-context)")
    sw.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    sw.add_argument("--tiers", type=_tiers, default=["off"],
                    help="KV tiers below each worker's device, or a comma-separated list to "
                         f"compare: {', '.join(TIERS)} (unbounded: a device cache without bound, "
                         "the ceiling); capacities and reload rates from the profile")
    sw.add_argument("--sessions-per-worker", type=float, default=None,
                    help="scale the sessions with the cluster (instead of --sessions)")
    sw.add_argument("--block-tokens", type=int, default=None,
                    help="simulate the KV cache in blocks of this many tokens (a multiple of the "
                         "profile's), capacities and per-block costs scaled: sim/coarsening.py")
    sw.add_argument("--route-candidates", type=int, default=None,
                    help="the policy chooses among the workers holding a match and this many "
                         "others of each role drawn at random: sim/coarsening.py")
    sw.add_argument("--peer-pulls", action="store_true",
                    help="the policy plans peer prefix pulls and the workers make them, over "
                    "links priced by locality (the profile's workers_per_node, nodes_per_rack, "
                    "*_bytes_per_s)")
    sw.add_argument("--out", default="sim_sweep.json", help="file name under bench/results/")
    sw.set_defaults(func=cmd_sweep)
    from sim.autoscale import add_flags

    add_flags(sub.add_parser("autoscale", help="the SLO planner against static fleets and "
                                               "queue depth over one trace"))
    sub.choices["autoscale"].set_defaults(func=cmd_autoscale)
    va = sub.add_parser("validate", help="compare with the real bench/policies.py run")
    va.add_argument("--profile-file", default=None,
                    help="a JSON cost profile instead of the built-in tiny-cpu one")
    va.add_argument("--real", default=None,
                    help="a bench/policies.py JSON (default: bench/results/policies.json)")
    va.add_argument("--out", default="sim_validate.json", help="file name under bench/results/")
    va.set_defaults(func=cmd_validate)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
