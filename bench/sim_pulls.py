"""Peer prefix pulls in the simulator over an H200 fleet's fabric (issue 42): the agentic
workload of bench/sim_tiers.py (no KV tiers), P:D 1:3, kv_aware, with peer pulls off and on.
Workers fill nodes of 8 GPUs, nodes racks of 4 (sim/profiles/h200-llama3-8b-fabric.json): a
pull moves at 450 GB/s within a node (NVLink), 50 GB/s within a rack (400 Gb/s RDMA) and
12.5 GB/s across racks; the router's real policy prices each pull per locality pair and learns
it from the pulls the simulated workers make (router/fabric.py, sim/peer_pulls.py).

    .venv/bin/python bench/sim_pulls.py --sizes 16,64     # bench/results/sim_pulls.json
    .venv/bin/python bench/sim_pulls.py --sizes 1024 --block-tokens 128 --route-candidates 16 \\
        --out sim_pulls_1024.json

Each arm runs in a fresh process (a 1,024-worker run holds gigabytes); flags after these go to
`python -m sim sweep`.
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
from bench.sim_tiers import sweep_one  # noqa: E402

AGENTIC = ["--profile-file", str(ROOT / "sim" / "profiles" / "h200-llama3-8b-fabric.json"),
           "--ratios", "1:3", "--sessions-per-worker", "37.5", "--turns", "6",
           "--system-tokens", "30000", "--think-s", "60", "--sessions-per-s-per-worker", "0.08",
           "--policies", "kv_aware"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16", help="cluster sizes (workers), comma-separated")
    ap.add_argument("--out", default="sim_pulls.json", help="file under bench/results/")
    args, rest = ap.parse_known_args(argv)
    t0 = time.perf_counter()
    arms = {}
    for name, flags in (("off", []), ("on", ["--peer-pulls"])):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            arms[name] = pool.apply(sweep_one, ([*AGENTIC, "--sizes", args.sizes, *rest,
                                                 *flags],))
    result = {**{k: v for k, v in arms["off"].items() if k != "rows"},
              "rows": [*arms["off"]["rows"], *arms["on"]["rows"]],
              "wall_s": time.perf_counter() - t0}
    print(f"wrote {write_result(ROOT / 'bench' / 'results' / args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
