"""KV tiers on a real CPU cluster (issue 41): tiers off / host / host + disk / an unbounded device
cache (the ceiling), on traffic whose working set is many times the device cache.

    .venv/bin/python bench/kv_tiers.py                      # the full run (about 30 minutes)
    .venv/bin/python bench/kv_tiers.py --smoke              # a small run (about 3 minutes)
    .venv/bin/python bench/kv_tiers.py --colocated --arms off,host --workloads multi_turn

Each (workload, arm) runs on fresh processes: a prefill and a decode worker (or one colocated
worker with --colocated) and a router, over Redis, SmolLM2-135M (`tandem prepare-model`), blocks
of 16 tokens and --num-blocks device blocks per worker. The same seeded sessions go to every
arm, through `tandem bench`'s runner (loadgen/), streaming, closed loop, visited round-robin:

- `multi_turn`: chat sessions with ~350-token system prompts, turn t of every session before
  turn t+1 of any;
- `agentic`: agents over a few long shared contexts, one tool output per step, each agent coming
  back only after every other one took a step;
- `no_reuse`: fresh prompts that share nothing (what the tiers cost on misses).

Arms: `off` (device cache only), `host` (--host-kv-gb big enough for the working set), `host_disk`
(a host tier smaller than the working set over a disk tier in a temporary folder, so the disk
serves too), `ceiling` (--ceiling-num-blocks device blocks: nothing is evicted).

Per arm: hit ratio (cached prompt tokens / prompt tokens, from the `tandem` field of the answers:
the worker that computed each prompt), the same by tier, prompt tokens recomputed, the hit ratio
as a share of the ceiling arm's, TTFT p50/p99 (client side, streaming), output tokens/s and
requests/s, and the workers' tier counters. Writes bench/results/kv_tiers.json (--out), prints
the table and the goals of issue 41 checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# bench/ is on sys.path when run as a script: its siblings import by their bare names.
import redis  # noqa: E402
from kv_tiers_report import (  # noqa: E402
    add_shares,
    goals,
    markdown,
    session_context_tokens,
    summarize,
)
from provenance import write_result  # noqa: E402

from common.registry import RedisKeys  # noqa: E402
from loadgen import workload  # noqa: E402
from loadgen.runner import RunConfig, Runner  # noqa: E402
from testing.cluster import Router, Worker  # noqa: E402
from testing.metrics import series_sum  # noqa: E402
from testing.redis_server import REDIS_URL  # noqa: E402

BLOCK_SIZE = 16
TIER_COUNTERS = ("hit_blocks", "offload_blocks", "reload_blocks", "reload_seconds",
                 "dropped_offloads")


def build_workloads(args) -> dict[str, tuple[list[workload.Session], int | None]]:
    """Each workload's sessions and the seed that shuffles each round's order (None: in order)."""
    s = args.size
    return {
        "multi_turn": (workload.multi_turn(round(36 * s), turns=4, seed=args.seed,
                                           system_words=300, user_words=25, max_tokens=16), None),
        "agentic": (workload.agentic(round(48 * s), seed=args.seed + 1, num_contexts=8,
                                     context_words=300, steps=3, tool_words=60, max_tokens=16),
                    args.seed + 1),
        "no_reuse": (workload.no_reuse(round(32 * s), seed=args.seed + 2, prompt_words=300,
                                       max_tokens=16), None),
    }


def arm_flags(arm: str, args, work: Path, role: str) -> tuple[int, list[str]]:
    """The device blocks and the tier flags of a worker of `role` in `arm`."""
    if arm == "off":
        return args.num_blocks, []
    if arm == "host":
        return args.num_blocks, ["--host-kv-gb", str(args.host_kv_gb)]
    if arm == "host_disk":
        return args.num_blocks, ["--host-kv-gb", str(args.small_host_kv_gb), "--disk-kv-dir",
                                 str(work / f"disk-{role}"), "--disk-kv-gb", str(args.disk_kv_gb)]
    if arm == "ceiling":
        return args.ceiling_num_blocks, []
    raise ValueError(f"unknown arm {arm!r}")


def run_arm(arm: str, sessions, shuffle_seed, args, folder: Path, work: Path) -> dict:
    """One fresh cluster for `arm`, the workload sent through it, everything stopped after."""
    roles = ["colocated"] if args.colocated else ["prefill", "decode"]
    ns = f"bench-tiers-{arm}-{uuid.uuid4().hex[:6]}"
    workers: list[Worker] = []
    router = None
    try:
        for role in roles:
            num_blocks, flags = arm_flags(arm, args, work, role)
            workers.append(Worker(role, str(folder), cache_dir=work, namespace=ns,
                                  num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                  extra=["--threads", str(args.threads), *flags]))
        router = Router(folder, ns, cache_dir=work, block_size=BLOCK_SIZE)
        router.wait_workers(len(roles))
        warm_up(router, folder.name)
        runner = Runner(RunConfig(base_url=f"{router.url}/v1", model=folder.name,
                                  concurrency=args.concurrency, timeout_s=600))
        t0 = time.perf_counter()
        records = asyncio.run(runner.run_round_robin(sessions, shuffle_seed))
        summary = summarize(records, time.perf_counter() - t0)
        summary["session_context_tokens"] = session_context_tokens(records)
        summary["blocks_held"] = blocks_held(ns, workers)
        summary["tiers"] = {w.role: tier_counters(w) for w in workers}
        return summary
    finally:
        for p in [router, *workers]:
            if p is not None:
                p.close()


def warm_up(router: Router, model: str) -> None:
    """One short request first: the first step of a fresh worker is not what is measured."""
    r = router.client.post("/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Warm up."}]})
    r.raise_for_status()


def blocks_held(ns: str, workers: list[Worker]) -> int:
    """Distinct blocks the cluster's workers hold in any tier, from their published block sets
    (Redis): in the ceiling arm, which evicts nothing, the workload's working set."""
    keys = RedisKeys(ns)
    r = redis.Redis.from_url(REDIS_URL)
    try:
        seen, last = -1, None
        for _ in range(20):  # until the publishers have caught up: two equal reads in a row
            held: set[bytes] = set()
            for w in workers:
                for medium in ("device", "host", "disk"):
                    held |= r.smembers(keys.blocks(w.worker_id, medium))
            if len(held) == seen:
                break
            seen, last = len(held), held
            time.sleep(1.0)
        return len(last or ())
    finally:
        r.close()


def tier_counters(w: Worker) -> dict:
    m = w.metrics()
    return {name: {medium: series_sum(m, f"tandem_worker_kv_tier_{name}_total", medium=medium)
                   for medium in ("host", "disk")} for name in TIER_COUNTERS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--colocated", action="store_true",
                    help="one colocated worker instead of 1 prefill + 1 decode")
    ap.add_argument("--arms", default="off,host,host_disk,ceiling")
    ap.add_argument("--workloads", default="multi_turn,agentic,no_reuse")
    ap.add_argument("--size", type=float, default=1.0,
                    help="scales the number of sessions of every workload")
    ap.add_argument("--num-blocks", type=int, default=96,
                    help="device KV blocks per worker (16 tokens each); must hold --concurrency "
                    "of the longest requests (~41 blocks), or a decode worker refuses KV imports")
    ap.add_argument("--ceiling-num-blocks", type=int, default=2048,
                    help="device blocks of the ceiling arm: more than the working set")
    ap.add_argument("--host-kv-gb", type=float, default=1.5,
                    help="host tier of the `host` arm: holds the working set")
    ap.add_argument("--small-host-kv-gb", type=float, default=0.15,
                    help="host tier of the `host_disk` arm: a part of the working set")
    ap.add_argument("--disk-kv-gb", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="a small run: --size 0.125, the multi_turn and no_reuse workloads, one "
                    "request in flight, 40 device blocks, a 0.02 GiB host tier over the disk")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_tiers.json"))
    args = ap.parse_args()
    if args.smoke:
        args.size = min(args.size, 0.125)
        args.workloads = "multi_turn,no_reuse"
        args.concurrency, args.num_blocks, args.small_host_kv_gb = 1, 40, 0.02
    from engine.model_store import resolve_model

    folder = resolve_model(args.model)
    arms = args.arms.split(",")
    built = build_workloads(args)
    device_tokens = args.num_blocks * BLOCK_SIZE  # one worker's
    num_workers = 1 if args.colocated else 2
    results: dict[str, dict] = {}
    # The workers' and the router's logs, one folder per (workload, arm); ignored by git.
    logs = Path(args.out).parent / f"kv_tiers-{time.strftime('%Y%m%d-%H%M%S')}"
    errors: dict[str, str] = {}
    for name in args.workloads.split(","):
        sessions, shuffle_seed = built[name]
        runs = {}
        for arm in arms:
            work = logs / f"{name}-{arm}"
            work.mkdir(parents=True)
            try:
                runs[arm] = run_arm(arm, sessions, shuffle_seed, args, folder, work)
            except Exception as e:  # noqa: BLE001 - one failed arm is reported, not fatal
                errors[f"{name}.{arm}"] = f"{type(e).__name__}: {e}"
                print(f"{name} {arm} failed: {e} (logs: {work})", file=sys.stderr, flush=True)
                continue
            finally:
                for disk in work.glob("disk-*"):  # the disk tiers' blocks
                    shutil.rmtree(disk)
            print(json.dumps({"workload": name, "arm": arm,
                              **{k: runs[arm][k] for k in ("ok", "requests", "hit_ratio",
                                                           "ttft_p50_s", "wall_s")}}),
                  file=sys.stderr, flush=True)
        add_shares(runs)
        # The ceiling arm's distinct blocks are the working set (None without that arm).
        ws = runs["ceiling"]["blocks_held"] * BLOCK_SIZE if "ceiling" in runs else None
        results[name] = {"num_sessions": len(sessions),
                         "num_requests": sum(len(s.turns) for s in sessions),
                         "working_set_tokens": ws,
                         "working_set_vs_device": ws / device_tokens if ws else None,
                         # P/D: against both workers' device caches together
                         "working_set_vs_cluster_device": ws / (device_tokens * num_workers)
                                                          if ws else None,
                         "arms": runs}
    out = {"model": args.model, "topology": "colocated" if args.colocated else "pd",
           "block_size": BLOCK_SIZE, "num_blocks": args.num_blocks,
           "device_cache_tokens": device_tokens, "ceiling_num_blocks": args.ceiling_num_blocks,
           "host_kv_gb": args.host_kv_gb, "small_host_kv_gb": args.small_host_kv_gb,
           "disk_kv_gb": args.disk_kv_gb, "concurrency": args.concurrency,
           "threads": args.threads, "size": args.size, "seed": args.seed,
           "workloads": results, "goals": goals(results), "errors": errors, "logs": str(logs)}
    write_result(args.out, out)
    print(markdown(results))
    print(json.dumps(out["goals"], indent=2))
    print(f"result: {args.out}; logs: {logs}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
