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
import sys
from pathlib import Path

from sim.fleet_cache import TIERS
from sim.profile import calibrated, load
from sim.sweep import simulate, sweep
from sim.workload import from_chat

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("kv_aware", "round_robin", "random")


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
    from bench.provenance import write_result  # commit, machine, command and time, first

    write_result(ROOT / "bench" / "results" / name, data)


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
