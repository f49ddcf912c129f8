"""Routing around a backed-up prefill pool, on the mixed workload.

    .venv/bin/python bench/backlog.py [--requests 32] [--repeat 2]

The mixed workload (half ~250-word prompts with 4-token answers, half short prompts with 48-token
answers, 4 in flight) on 1 prefill + 1 decode SmolLM2 worker (1 thread each), with kv_aware's
local prefill while the prefill pool is backed up on (the default) and off
(`TANDEM_ROUTER_LOCAL_PREFILL_WHEN_BACKED_UP=false`: the conditional rule alone, which sent every
request of this workload through the single prefill worker's queue). Runs alternate, each on a
fresh cluster (cold caches). JSON: bench/results/backlog.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from clusters import ROOT, run_on_cluster  # bench/ is on sys.path when run as a script
from provenance import write_result

from loadgen import workload

KEYS = ("ttft_s", "itl_s", "e2e_s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    sessions = workload.mixed(args.requests, seed=0, long_prompt_words=250, long_answer_tokens=48)
    modes = {"backlog_routing": {},
             "conditional_only": {"TANDEM_ROUTER_LOCAL_PREFILL_WHEN_BACKED_UP": "false"}}
    runs: dict[str, list] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for mode, env in modes.items():
                s = run_on_cluster(f"backlog-{mode}-{i}", ["prefill", "decode"], args.model,
                                   "mixed", sessions, Path(tmp), worker_args=["--threads", "1"],
                                   router_env=env)
                row = {"ok": s["ok"], "output_tokens_per_s": s["output_tokens_per_s"],
                       "plans": s["route_plans"],
                       **{f"{k}_{q}": s[k][q] for k in KEYS for q in ("p50", "p99")}}
                runs[mode].append(row)
                print(json.dumps({mode: row}), file=sys.stderr)
    med = {m: {k: statistics.median(r[k] for r in rows) for k in rows[0]
               if k not in ("plans", "ok")}
           for m, rows in runs.items()}
    ratios = {k: med["backlog_routing"][k] / med["conditional_only"][k]
              for k in med["backlog_routing"]
              if med["conditional_only"][k]}
    out = {"model": args.model, "requests": args.requests, "concurrency": 4, "runs": runs,
           "medians": med, "backlog_over_conditional_only": ratios}
    write_result(ROOT / "bench" / "results" / "backlog.json", out)
    print(json.dumps({"medians": med, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
