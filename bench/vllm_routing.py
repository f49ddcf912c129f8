"""Routing over two real vLLM CPU servers: Tandem's exact index (a `tandem vllm-bridge`
per server), Tandem's approximate index (static `vllm:colocated=URL` workers), vllm-router's
cache-aware policy, vllm-router's own KV-event index (`kv_aware`) and round robin, on the same
seeded multi-turn chat load.

    bash bench/setup_vllm_cpu.sh && .venv/bin/tandem prepare-model
    .venv/bin/python bench/vllm_routing.py --conversations 16 --turns 4 --concurrency 4 \\
        --scenario steady,replicas,out_of_band,restart,router_restart --seed 0

Two vLLM servers (one core each, block size 32, `--num-gpu-blocks-override 48`: a small cache
that evicts finished conversations), with KV events and a bridge each, are started once. Every
arm starts on a cold cache: `POST /reset_prefix_cache` (VLLM_SERVER_DEV_MODE=1), a one-token
request so vLLM publishes the clear, and the bridges' sets seen empty; every router is a fresh
process. The scenarios (`--scenario`, default all) are when an approximate index (one learnt
from the router's own decisions) can be wrong; every arm of a scenario meets the same event at the
same point of the same load:

- `steady`: one router, every request through it.
- `replicas`: 4 router replicas, every conversation's turns going round them (a load balancer
  that does not pin sessions): an approximate index learns only from its own replica's decisions.
  `replicas2`: the same with 2 (with `steady` and `replicas`, the sweep over 1 / 2 / 4 routers:
  `--scenario steady,replicas2,replicas --out vllm_routing_sweep.json`).
- `out_of_band`: one router; each conversation's odd turns go straight to a vLLM server drawn
  from (seed, conversation, turn), as another client or router of the fleet (a batch job) would
  send them; the even turns go through the router (the ideal: to the server of the turn before).
  Only an index built from the servers' own events knows where those prefixes are.
- `restart`: one router; when conversation conversations // 2 is about to send its turn
  turns // 2 (the others in flight are mid-way too) the load pauses, in-flight requests finish,
  the second server restarts (same ports, empty cache), and the load resumes.
  Its conversations' prefixes are gone everywhere, so the ideal loses them too.
- `router_restart`: the same pause, but the arm's router restarts (a rolling update): an index
  kept in the router starts empty, the exact one is in Redis; the ideal (no router) loses nothing.

Per arm: vLLM's prefix-cache hit ratio (both servers' `vllm:prefix_cache_hits_total` /
`queries_total`, deltas over the arm), TTFT p50/p99 (client-side, streaming) and errors. The
ideal is measured the same way: `ideal-sticky` pins each conversation to one server from the
client (no router), so every turn after the first finds all its previous request cached (the
prompt and the blocks its answer filled) unless the small cache evicted it.
`prev_prompt_hit_ratio` is the floor of that ideal from the token counts alone (without
out-of-band traffic or a restart). The summary gives
exact/ideal and exact over each other arm. `tandem-exact-full` is the exact arm with
`--vllm-report-full-prefix` (every request re-reports its cached prefix): its cost is its TTFT and
the KV event bytes and blocks the servers published (counted by a second subscriber). Writes
bench/results/vllm_routing.json (`--out`), keeping from it the runs of the scenarios not run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import write_result  # noqa: E402
from vllm_routing_load import (  # noqa: E402
    EventTally,
    MidRunPause,
    Scenario,
    SpreadRunner,
    VLLMRouterProc,
    prev_prompt_hits,
)
from vllm_routing_report import summarize  # noqa: E402

from loadgen.report import percentiles  # noqa: E402
from loadgen.runner import RunConfig  # noqa: E402
from loadgen.workload import multi_turn  # noqa: E402
from testing.cluster import TOKEN, Router  # noqa: E402
from testing.redis_server import REDIS_URL  # noqa: E402
from testing.vllm_fleet import FleetIndex, VLLMBridge  # noqa: E402
from testing.vllm_server import MODEL, VLLMOptions, VLLMServer  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BLOCK_SIZE = 32
ARMS = ("ideal-sticky", "tandem-exact", "tandem-exact-full", "tandem-approx",
        "vllm-router-cache-aware", "vllm-router-kv-aware", "round-robin")
SCENARIOS = {"steady": Scenario(), "replicas2": Scenario(routers=2),
             "replicas": Scenario(routers=4),
             "out_of_band": Scenario(out_of_band=True), "restart": Scenario(pause="server"),
             "router_restart": Scenario(pause="router")}
SCENARIO_NOTES = {
    "steady": "1 router, every request through it",
    "replicas2": "2 router replicas, each conversation's turns going round them",
    "replicas": "4 router replicas, each conversation's turns going round them",
    "out_of_band": "1 router; odd turns straight to a server drawn from (seed, conversation, "
                   "turn), as another client of the fleet would send them",
    "restart": "1 router; when conversation n/2 reaches turn t/2 the load pauses and the second "
               "vLLM server restarts on the same ports, cache empty",
    "router_restart": "the same pause, and the arm's router restarts (the ideal has none)",
}


def start_routers(arm: str, n: int, servers, folder: Path, namespace: str, log_dir: Path) -> list:
    static = [a for s in servers for a in ("--worker", f"vllm:colocated={s.url}")]
    out = []
    for _ in range(n if arm != "ideal-sticky" else 0):  # the sticky client needs no router
        if arm.startswith("tandem-exact"):
            extra = ["--vllm-report-full-prefix"] if arm.endswith("-full") else []
            r = Router(folder, namespace, cache_dir=log_dir, extra=extra)
        elif arm == "tandem-approx":
            r = Router(folder, None, cache_dir=log_dir, token=None, redis_url=None, extra=static)
        elif arm == "round-robin":
            r = Router(folder, None, cache_dir=log_dir, policy="round_robin", token=None,
                       redis_url=None, extra=static)
        else:
            policy = "cache_aware" if arm == "vllm-router-cache-aware" else "kv_aware"
            out.append(VLLMRouterProc(servers, policy, log_dir, BLOCK_SIZE))
            continue
        out.append(r)
        r.wait_workers(len(servers), timeout=60)
    return out


def cold_cache(servers: list[VLLMServer], bridges: list[VLLMBridge], index: FleetIndex) -> None:
    """Empties both caches and waits for the bridges to publish it: vLLM queues its clear until
    the engine steps, so a 1-token request follows the reset."""
    for s in servers:
        s.reset_prefix_cache()
        httpx.post(f"{s.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}).raise_for_status()
    deadline = time.monotonic() + 30
    while any(index.blocks(b.worker_id) for b in bridges):
        if time.monotonic() > deadline:
            raise RuntimeError("the bridges' sets did not empty after the reset")
        time.sleep(0.2)


def run_arm(arm: str, name: str, args, fleet, folder: Path, log_dir: Path) -> dict:
    servers, bridges, index, namespace, tallies = fleet
    scenario = SCENARIOS[name]
    cold_cache(servers, bridges, index)
    routers = start_routers(arm, scenario.routers, servers, folder, namespace, log_dir)
    # vLLM's counters restart at 0 with the server: what it counted before is kept here.
    counted_before_restart = [(0.0, 0.0) for _ in servers]
    try:
        before = [s.prefix_cache() for s in servers]
        events_before = [t.snapshot() for t in tallies]
        sessions = multi_turn(args.conversations, turns=args.turns, seed=args.seed,
                              system_words=60, user_words=20, max_tokens=args.max_tokens)
        server_urls = [f"{s.url}/v1" for s in servers]
        urls = server_urls if arm == "ideal-sticky" else [f"{r.url}/v1" for r in routers]
        config = RunConfig(base_url=urls[0], model=MODEL, concurrency=args.concurrency,
                           seed=args.seed)

        def restart() -> None:
            if scenario.pause == "server":
                counted_before_restart[-1] = servers[-1].prefix_cache()
                servers[-1].restart()
            elif routers:
                for r in routers:
                    r.close()
                routers[:] = start_routers(arm, scenario.routers, servers, folder, namespace,
                                           log_dir)
                urls[:] = [f"{r.url}/v1" for r in routers]

        at = (args.conversations // 2, args.turns // 2)  # mid-run, mid-conversation
        pause = scenario.pause and MidRunPause(at, restart)
        runner = SpreadRunner(config, urls, arm == "ideal-sticky",
                              server_urls if scenario.out_of_band else None, pause or None)
        t0 = time.perf_counter()
        records = asyncio.run(runner.run(sessions))
        wall_s = time.perf_counter() - t0
        after = [s.prefix_cache() for s in servers]
        if scenario.pause == "server":
            restarted = counted_before_restart[-1]
            after[-1] = (after[-1][0] + restarted[0], after[-1][1] + restarted[1])
        time.sleep(1)  # the last events arrive
        events = [(a[0] - b[0], a[1] - b[1])
                  for a, b in zip((t.snapshot() for t in tallies), events_before, strict=True)]
    finally:
        for r in routers:
            r.close()
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ok = [r for r in records if r.error is None]
    sent = sum(r.prompt_tokens for r in ok)
    ttft = percentiles([r.ttft_s * 1000 for r in ok if r.ttft_s is not None])
    return {"scenario": name, "arm": arm, "routers": scenario.routers,
            "out_of_band": scenario.out_of_band, "pause": scenario.pause, "requests": len(records),
            "errors": len(records) - len(ok), "wall_s": round(wall_s, 1),
            "hit_tokens": hits, "query_tokens": queries,
            "hit_ratio": round(hits / queries, 4) if queries else None,
            "prev_prompt_hit_ratio": round(prev_prompt_hits(ok, BLOCK_SIZE) / sent, 4)
                                     if sent else None,
            "per_server_queries": [a[1] - b[1] for a, b in zip(after, before, strict=True)],
            "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
            "event_bytes": sum(e[0] for e in events),
            "event_blocks_stored": sum(e[1] for e in events)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--scenario", default=",".join(SCENARIOS),
                    help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=48, help="KV blocks per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="vllm_routing.json", help="file name under bench/results/")
    args = ap.parse_args()

    from engine.model_store import resolve_model

    folder = resolve_model(MODEL)
    log_dir = RESULTS / f"vllm-routing-{time.strftime('%Y%m%d-%H%M%S')}"
    log_dir.mkdir(parents=True)
    namespace = f"bench-vllm-routing-{uuid.uuid4().hex[:8]}"
    index = FleetIndex(namespace)
    servers, bridges, tallies, runs = [], [], [], []
    result: dict = {"summary": []}
    try:
        for core in (0, 1):
            servers.append(VLLMServer(folder, log_dir, VLLMOptions(
                core=core, block_size=BLOCK_SIZE, num_blocks=args.num_blocks, kv_events=True,
                topic=f"kv@vllm{core}@{MODEL}", dev_mode=True, max_num_seqs=args.concurrency)))
        for s in servers:
            s.wait_ready()
        for s in servers:
            bridges.append(VLLMBridge(s, "colocated", namespace, log_dir, redis_url=REDIS_URL,
                                      token=TOKEN))
            tallies.append(EventTally(s.events_endpoint))
        index.wait_registered([b.worker_id for b in bridges])
        fleet = (servers, bridges, index, namespace, tallies)
        names = args.scenario.split(",")
        # Runs of scenarios not run now are kept from the last results (the older format had
        # no scenario: its 1 and 4 replicas were steady and replicas).
        kept = []
        with contextlib.suppress(OSError, ValueError):
            for r in json.loads((RESULTS / args.out).read_text())["runs"]:
                r.setdefault("scenario", {1: "steady", 4: "replicas"}.get(r.get("routers")))
                if r["scenario"] in SCENARIOS and r["scenario"] not in names:
                    kept.append(r)
        for name in names:
            for arm in args.arms.split(","):
                try:
                    res = run_arm(arm, name, args, fleet, folder, log_dir)
                except Exception as e:  # noqa: BLE001 - one failed arm is reported, not fatal
                    res = {"scenario": name, "arm": arm, "error": f"{type(e).__name__}: {e}"}
                runs.append(res)
                print(json.dumps(res), file=sys.stderr, flush=True)
                result = write_results(args, kept + runs)  # after every arm: a partial run counts
    finally:
        for p in [*tallies, *bridges, *servers]:
            p.close()
        index.delete()
    print(json.dumps(result["summary"], indent=2))
    return 0


def write_results(args, runs: list[dict]) -> dict:
    result = {"conversations": args.conversations, "turns": args.turns,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "num_blocks": args.num_blocks, "block_size": BLOCK_SIZE, "seed": args.seed,
              "scenarios": SCENARIO_NOTES, "runs": runs, "summary": summarize(runs, SCENARIOS)}
    write_result(RESULTS / args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(main())
