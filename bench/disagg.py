"""Disaggregated (1 prefill + 1 decode) vs colocated (2 colocated workers) on the mixed workload
(long-prompt/short-answer interleaved with short-prompt/long-answer), in one run.

    .venv/bin/python bench/disagg.py [--model smollm2-135m-instruct] [--requests 24] [--threads 1]

Both set-ups get the same cores (`--threads` per worker, two workers) and the same seeded
requests through `tandem bench`'s runner (closed loop, 4 in flight). The claim under test: with
prefill on its own pool, long prefills stop stalling running decode streams (ITL p99), at the cost
of a KV transfer per request. JSON: bench/results/disagg.json.
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
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    sessions = workload.mixed(args.requests, seed=0, long_prompt_words=250, long_answer_tokens=48)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, roles in (("disaggregated", ["prefill", "decode"]),
                            ("colocated", ["colocated", "colocated"])):
            runs[name] = s = run_on_cluster(f"disagg-{name}", roles, args.model, "mixed",
                                            sessions, Path(tmp),
                                            worker_args=["--threads", str(args.threads)])
            print(json.dumps({name: {"ok": s["ok"], "ttft_p99": s["ttft_s"]["p99"],
                                     "itl_p99": s["itl_s"]["p99"], "plans": s["route_plans"]}}),
                  file=sys.stderr)
    d, c = runs["disaggregated"], runs["colocated"]
    ratios = {k: d[k]["p99"] / c[k]["p99"] for k in ("ttft_s", "itl_s", "e2e_s")}
    ratios |= {f"{k}_p50": d[k]["p50"] / c[k]["p50"] for k in ("ttft_s", "itl_s")}
    out = {"model": args.model, "requests": args.requests, "threads_per_worker": args.threads,
           "runs": runs, "disaggregated_over_colocated": ratios}
    write_result(ROOT / "bench" / "results" / "disagg.json", out)
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
