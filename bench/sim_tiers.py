"""The simulator's agentic sweep with KV tiers (issue 41): the H200 Llama-3-8B profile, P:D 1:3,
kv_aware, 37.5 sessions per worker (the issue's 600 per 16) of 6 turns on their own ~30,000-token
contexts, 60 s think time, 0.08 sessions/s per worker; tiers off, host, host + disk and an
unbounded device (the ceiling). Any `python -m sim sweep` flag given after these overrides it.

    .venv/bin/python bench/sim_tiers.py --sizes 16,64      # bench/results/sim_tiers_agentic.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from sim.__main__ import parse, sweep  # noqa: E402

AGENTIC = ["--profile-file", str(ROOT / "sim" / "profiles" / "h200-llama3-8b.json"),
           "--ratios", "1:3", "--sessions-per-worker", "37.5", "--turns", "6",
           "--system-tokens", "30000", "--think-s", "60", "--sessions-per-s-per-worker", "0.08",
           "--policies", "kv_aware", "--tiers", "off,host,host+disk,unbounded"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16", help="cluster sizes (workers), comma-separated")
    ap.add_argument("--out", default="sim_tiers_agentic.json", help="file under bench/results/")
    args, rest = ap.parse_known_args(argv)
    sim_args = parse(["sweep", *AGENTIC, "--sizes", args.sizes, *rest])
    t0 = time.perf_counter()
    result = sweep(sim_args)
    result["wall_s"] = time.perf_counter() - t0
    print(f"wrote {write_result(ROOT / 'bench' / 'results' / args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
