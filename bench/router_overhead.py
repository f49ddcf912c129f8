"""Latency the router adds, against a fast fake worker process, at fixed request rates.

    .venv/bin/python bench/router_overhead.py [--rates 50,200,500] [--seconds 5]

One fake worker process serves both P/D protocols instantly, as a prefill and as a decode worker
on two ports (bench/router_targets.py, which starts every target). In the same run, open-loop
Poisson arrivals of non-streaming /v1/completions go to:
  direct       the fake decode worker itself (baseline)
  python-floor the least a Python router can add: a raw-ASGI proxy (uvicorn + aiohttp, no
               validation, tokenizing or routing) making the same two hops as tandem
  tandem       `tandem router` (kv_aware, P/D plan, static workers, in-process index)
  vllm-router  `vllm-router --vllm-pd-disaggregation` (if installed)
  sglang-router `sglang-router launch --pd-disaggregation` (if installed)
and the added latency is p50/p99 of each minus the direct run's, plus each router process's CPU
time per request (/proc). JSON: bench/results/router_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_meter import cpu_seconds  # noqa: E402 - bench/ is on sys.path when run as a script
from provenance import write_result  # noqa: E402
from router_targets import Targets  # noqa: E402

WARMUP = 20


async def load(url: str, rate: float, seconds: float, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    body = {"model": "tiny-random", "prompt": "hello router", "max_tokens": 2, "temperature": 0}
    latencies: list[float] = []
    errors = 0
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=500)) as client:
        for _ in range(WARMUP):  # warm connections and caches
            await client.post(url, json=body)

        async def one() -> None:
            nonlocal errors
            t = time.perf_counter()
            try:
                r = await client.post(url, json=body)
                if r.status_code != 200:
                    errors += 1
                    return
            except httpx.HTTPError:
                errors += 1
                return
            latencies.append(time.perf_counter() - t)

        tasks = []
        start = time.perf_counter()
        next_at = start
        while next_at - start < seconds:
            next_at += rng.expovariate(rate)
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    latencies.sort()
    return {"requests": len(tasks), "errors": errors, "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": latencies[max(int(len(latencies) * 0.99) - 1, 0)] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,200,500")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router_overhead.json"))
    args = ap.parse_args()
    from engine.tiny import build_tiny_random  # only to have a tokenizer folder

    logs = ROOT / "bench" / "results"
    logs.mkdir(parents=True, exist_ok=True)
    targets = Targets(logs)
    result: dict = {"cpus": os.cpu_count(), "seconds_per_rate": args.seconds, "runs": {}}
    try:
        targets.start(build_tiny_random(logs / "tiny-random"))
        targets.wait_ready()
        for rate in [float(r) for r in args.rates.split(",")]:
            row = {}
            for name, url in targets.urls.items():
                cpu0 = cpu_seconds(targets.pids[name])
                row[name] = asyncio.run(load(url, rate, args.seconds, seed=int(rate)))
                # The fake decode worker's own CPU for "direct"; the router process's otherwise.
                row[name]["cpu_ms_per_request"] = round(
                    (cpu_seconds(targets.pids[name]) - cpu0) / (row[name]["requests"] + WARMUP)
                    * 1e3, 3)
                print(json.dumps({"rate": rate, name: row[name]}), file=sys.stderr)
            base = row["direct"]
            for name in targets.urls:
                if name != "direct":
                    row[name]["added_p50_ms"] = row[name]["p50_ms"] - base["p50_ms"]
                    row[name]["added_p99_ms"] = row[name]["p99_ms"] - base["p99_ms"]
            result["runs"][str(int(rate))] = row
    finally:
        targets.stop()
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
