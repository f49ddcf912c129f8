"""Conditional disaggregation on vs off on multi-turn traffic, in one run.

    .venv/bin/python bench/conditional.py [--model smollm2-135m-instruct] [--sessions 8] [--turns 4]

Both arms get a fresh 1 prefill + 1 decode cluster and the same seeded multi-turn workload
(closed loop). "on" is the default kv_aware router: a decode worker that already holds most of a
conversation prefills the new turn itself. "off" (TANDEM_ROUTER_CONDITIONAL_DISAGG=false) sends
every turn through the prefill worker and a KV pull. JSON: bench/results/conditional.json, with
TTFT and end-to-end ratios on/off and the plans each arm took.
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
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()
    sessions = workload.multi_turn(args.sessions, turns=args.turns, seed=1, system_words=120,
                                   user_words=12, max_tokens=12)
    worker_args = ["--threads", "1"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, enabled in (("on", "true"), ("off", "false")):
            results[arm] = run_on_cluster(
                f"conditional-{arm}", ["prefill", "decode"], args.model, "multi-turn",
                sessions, Path(tmp), worker_args=worker_args, concurrency=args.concurrency,
                router_env={"TANDEM_ROUTER_CONDITIONAL_DISAGG": enabled})
            s = results[arm]
            print(json.dumps({"arm": arm, "ok": s["ok"], "plans": s["route_plans"],
                              "ttft_p50": s["ttft_s"]["p50"], "ttft_p99": s["ttft_s"]["p99"]}),
                  file=sys.stderr)
    on, off = results["on"], results["off"]
    ratios = {f"{metric}_{q}_on_over_off": on[metric][q] / off[metric][q]
              for metric in ("ttft_s", "e2e_s") for q in ("p50", "p90", "p99") if off[metric][q]}
    out = {"model": args.model, "sessions": args.sessions, "turns": args.turns, "runs": results,
           "ratios": ratios}
    path = ROOT / "bench" / "results" / "conditional.json"
    write_result(path, out)
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
