"""Routing policies on multi-turn traffic, in one run: kv_aware vs round_robin vs random.

    .venv/bin/python bench/policies.py [--model tiny-random] [--sessions 12] [--turns 4]
                                       [--repeat 3] [--concurrency 4]
                                       [--out bench/results/policies.json]

For each policy a fresh cluster (Redis namespace, 2 prefill + 1 decode workers, the router) gets the
same seeded multi-turn workload through `tandem bench`'s runner (closed loop, 4 sessions in flight,
or --concurrency). JSON: bench/results/policies.json, with hit ratio and TTFT ratios against
round_robin. With --repeat N the whole comparison runs N times (this machine's run-to-run spread is
large): `runs` holds the first, `repeats` every run's hit ratio and TTFT p50 (client and router
side).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from clusters import ROOT, run_on_cluster  # bench/ is on sys.path when run as a script
from provenance import write_result

from loadgen import workload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4, help="sessions in flight")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "policies.json"))
    args = ap.parse_args()
    sessions = workload.multi_turn(args.sessions, turns=args.turns, seed=0, system_words=30,
                                   user_words=8, max_tokens=8)
    results = {}
    repeats: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for policy in ("kv_aware", "round_robin", "random"):
                s = run_on_cluster(f"policy-{policy}", ["prefill", "prefill", "decode"], args.model,
                                   "multi-turn", sessions, Path(tmp), policy=policy,
                                   num_blocks=args.num_blocks, concurrency=args.concurrency)
                results.setdefault(policy, s)
                repeats.setdefault(policy, []).append({
                    "hit_ratio": s["prefix_hit_ratio"], "ttft_p50_s": s["ttft_s"]["p50"],
                    "server_ttft_p50_s": s["server_ttft_s"]["p50"], "ok": s["ok"]})
                print(json.dumps({"policy": policy, "ok": s["ok"],
                                  "hit_ratio": s["prefix_hit_ratio"],
                                  "ttft_p50": s["ttft_s"]["p50"], "ttft_p99": s["ttft_s"]["p99"]}),
                      file=sys.stderr)
    base = results["round_robin"]
    ratios = {p: {"hit_ratio_vs_round_robin": s["prefix_hit_ratio"] / base["prefix_hit_ratio"]
                  if base["prefix_hit_ratio"] else None,
                  "ttft_p50_vs_round_robin": s["ttft_s"]["p50"] / base["ttft_s"]["p50"],
                  "ttft_p99_vs_round_robin": s["ttft_s"]["p99"] / base["ttft_s"]["p99"]}
              for p, s in results.items()}
    out = {"model": args.model, "sessions": args.sessions, "turns": args.turns,
           "concurrency": args.concurrency, "runs": results,
           "repeats": repeats, "ratios": ratios}
    write_result(args.out, out)
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
