"""The simulator's agentic sweep with KV tiers (issue 41): the H200 Llama-3-8B profile, P:D 1:3,
kv_aware, 37.5 sessions per worker (the issue's 600 per 16) of 6 turns on their own ~30,000-token
contexts, 60 s think time, 0.08 sessions/s per worker; tiers off, host, host + disk and an
unbounded device (the ceiling). Any `python -m sim sweep` flag given after these overrides it.

    .venv/bin/python bench/sim_tiers.py --sizes 16,64      # bench/results/sim_tiers_agentic.json

1,024 workers do not fit one machine exactly (~150 million cached block entries, ~6 ms of the
router's policy a request): they run with the coarsenings of sim/coarsening.py,

    .venv/bin/python bench/sim_tiers.py --sizes 1024 --block-tokens 128 --route-candidates 16 \\
        --out sim_tiers_agentic_1024.json

and `--validate` checks those coarsenings where the exact run fits: the same sweep exact, exact
on other sessions (`--seed 1`: how far the figures move with the workload's draw alone), and
coarse, each row's figures beside the exact ones (`deltas`, and their extremes in `worst`):

    .venv/bin/python bench/sim_tiers.py --validate --sizes 16,64 --block-tokens 128 \\
        --route-candidates 16 --out sim_tiers_coarse_check.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from sim.__main__ import parse  # noqa: E402
from sim.sweep import sweep  # noqa: E402

AGENTIC = ["--profile-file", str(ROOT / "sim" / "profiles" / "h200-llama3-8b.json"),
           "--ratios", "1:3", "--sessions-per-worker", "37.5", "--turns", "6",
           "--system-tokens", "30000", "--think-s", "60", "--sessions-per-s-per-worker", "0.08",
           "--policies", "kv_aware", "--tiers", "off,host,host+disk,unbounded"]
# What `--validate` compares: relative for times and rates, absolute for ratios.
RELATIVE = ("ttft_p50_s", "ttft_p99_s", "goodput_rps", "throughput_rps")
ABSOLUTE = ("hit_ratio", "slo_attainment")


def sweep_isolated(argv: list[str]) -> dict:
    """`python -m sim sweep` with `argv`, each tier setting in a fresh process, one after the
    other: a 1,024-worker setting holds ~5 GB, and what a finished one held goes back to the
    machine only when its process ends."""
    tiers = parse(["sweep", *argv]).tiers
    results = []
    for t in tiers:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            results.append(pool.apply(sweep_one, ([*argv, "--tiers", t],)))
    rows = sorted((row for r in results for row in r["rows"]),  # the sweep's own order
                  key=lambda row: (row["workers"], row["prefill"], tiers.index(row["tiers"])))
    return {**results[0], "rows": rows}


def sweep_one(argv: list[str]) -> dict:
    return sweep(parse(["sweep", *argv]))


def figures(row: dict) -> dict[str, float]:
    return {"hit_ratio": row["hit_ratio"], "ttft_p50_s": row["ttft_s"]["p50"],
            "ttft_p99_s": row["ttft_s"]["p99"], "goodput_rps": row["goodput_rps"],
            "throughput_rps": row["throughput_rps"], "slo_attainment": row["slo_attainment"]}


def compare(exact: dict, other: dict) -> dict:
    """`other`'s rows against `exact`'s, row by row (same sizes and tiers): each figure's
    difference (relative or absolute, as `RELATIVE` and `ABSOLUTE` say) and the extremes."""
    deltas = []
    for e, o in zip(exact["rows"], other["rows"], strict=True):
        assert (e["workers"], e["tiers"]) == (o["workers"], o["tiers"])
        fe, fo = figures(e), figures(o)
        d = {k: (fo[k] - fe[k]) / fe[k] for k in RELATIVE}
        d.update({k: fo[k] - fe[k] for k in ABSOLUTE})
        d["ttft_p50_ms"] = (fo["ttft_p50_s"] - fe["ttft_p50_s"]) * 1e3
        deltas.append({"workers": e["workers"], "tiers": e["tiers"], **d})
    keys = [*RELATIVE, *ABSOLUTE, "ttft_p50_ms"]
    worst = {k: max((d[k] for d in deltas), key=abs) for k in keys}
    return {"deltas": deltas, "worst": worst}


def validate(argv: list[str], coarse_flags: list[str]) -> dict:
    """The sweep exact, exact on another draw of sessions, and coarse (`coarse_flags`)."""
    runs = {"exact": sweep_isolated([*AGENTIC, *argv]),
            "exact_seed1": sweep_isolated([*AGENTIC, *argv, "--seed", "1"]),
            "coarse": sweep_isolated([*AGENTIC, *argv, *coarse_flags])}
    return {"coarse_flags": coarse_flags, "runs": runs,
            "coarse_vs_exact": compare(runs["exact"], runs["coarse"]),
            "seed1_vs_exact": compare(runs["exact"], runs["exact_seed1"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16", help="cluster sizes (workers), comma-separated")
    ap.add_argument("--out", default="sim_tiers_agentic.json", help="file under bench/results/")
    ap.add_argument("--validate", action="store_true",
                    help="run exact, exact with --seed 1, and with the coarsening flags given")
    ap.add_argument("--block-tokens", type=int, default=None, help="sim/coarsening.py")
    ap.add_argument("--route-candidates", type=int, default=None, help="sim/coarsening.py")
    args, rest = ap.parse_known_args(argv)
    coarse = [*(["--block-tokens", str(args.block_tokens)] if args.block_tokens else []),
              *(["--route-candidates", str(args.route_candidates)]
                if args.route_candidates else [])]
    t0 = time.perf_counter()
    if args.validate:
        if not coarse:
            ap.error("--validate checks --block-tokens and/or --route-candidates: give one")
        result = validate(["--sizes", args.sizes, *rest], coarse)
    else:
        result = sweep_isolated([*AGENTIC, "--sizes", args.sizes, *coarse, *rest])
    result["wall_s"] = time.perf_counter() - t0
    print(f"wrote {write_result(ROOT / 'bench' / 'results' / args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
