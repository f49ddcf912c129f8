"""The SLO planner in the simulator (`python -m sim autoscale`): the ramp, burst and diurnal
traces on the H200 Llama-3-8B profile, again with another seed, and again with half the KV
blocks per worker; each run compares the planner with static_peak, static_mean and
queue_depth over the same trace. Written after each run:

    .venv/bin/python bench/sim_autoscale.py            # bench/results/sim_autoscale.json
    .venv/bin/python bench/sim_autoscale.py --only burst:0:1.0

Done when (per run): the planner meets both SLOs for >= 95% of requests, with <= 0.7x the
worker-hours of static_peak, and more SLO-met requests per worker-hour than queue_depth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from sim.__main__ import parse  # noqa: E402
from sim.autoscale import compare, setup_from  # noqa: E402

# (trace, seed, KV blocks scale)
MATRIX = [(t, 0, 1.0) for t in ("ramp", "burst", "diurnal")] + \
    [(t, 1, 1.0) for t in ("ramp", "burst", "diurnal")] + \
    [(t, 0, 0.5) for t in ("ramp", "burst", "diurnal")]


def _row(run: dict) -> dict:
    """One line of the table: each policy's attainment, worker-hours and SLO-met requests per
    worker-hour, and the goals."""
    by = {p["policy"]: p for p in run["policies"]}
    return {"trace": run["trace"]["trace"], "seed": run["seed"],
            "kv_blocks": run["profile"]["num_blocks"],
            **{f"{name}_{k}": by[name][k] for name in by
               for k in ("attainment", "worker_hours", "slo_met_per_worker_hour")},
            **run["goals"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="trace:seed:kv_scale[,...] of the matrix")
    ap.add_argument("--out", default="sim_autoscale.json", help="file under bench/results/")
    args, rest = ap.parse_known_args(argv)
    matrix = MATRIX if args.only is None else [
        (t, int(s), float(k)) for t, s, k in (x.split(":") for x in args.only.split(","))]
    runs, rows, t0 = [], [], time.perf_counter()
    for trace, seed, kv_scale in matrix:
        sim_args = parse(["autoscale", "--trace", trace, "--seed", str(seed),
                          "--kv-blocks-scale", str(kv_scale), *rest])
        t1 = time.perf_counter()
        run = {"seed": seed, "kv_blocks_scale": kv_scale,
               **compare(setup_from(sim_args), sim_args.policies)}
        run["wall_s"] = time.perf_counter() - t1
        runs.append(run)
        rows.append(_row(run))
        print(rows[-1], flush=True)
        path = write_result(ROOT / "bench" / "results" / args.out,
                            {"command": "bench/sim_autoscale.py " + " ".join(argv or sys.argv[1:]),
                             "rows": rows, "runs": runs, "wall_s": time.perf_counter() - t0})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
