"""The P<->D network decides the plan: transfer time and kv_aware's choice on two shaped links.

    sudo .venv/bin/python bench/network.py [--model smollm2-135m-instruct] [--requests 6]

Two "hosts": the router, Redis and the prefill worker stay in this network namespace; the decode
worker runs in its own namespace joined by a veth pair, and `tc netem` shapes both ends of the
link's rate with a token bucket (tbf), once per profile: 25 Gbit/s, 1 Gbit/s and 100 Mbit/s.
UCX is limited to TCP so KV really crosses the link. Per profile a fresh router starts (so it
measures the link from scratch), the decode worker is kept busy with background streams (what
makes local prefill on it costly), and long distinct prompts go through one at a time. The
router runs kv_aware with local prefill allowed for any prompt
(`local_prefill_min_cached_fraction=0`, no uncached-token cap), so its cost model alone chooses
between "prefill on P + pull the KV" and "prefill on D". Reported per profile: plans taken, KV
transfer seconds and bytes of the disaggregated requests (the decode worker's own timing), the
bandwidth the router learned, TTFT. JSON: bench/results/network.json. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
from clusters import ROOT  # bench/ is on sys.path when run as a script
from provenance import write_result

from testing.cluster import Router, Worker
from testing.netns import Link
from testing.processes import free_port

ROOT_IP, NS_IP = "10.232.0.1", "10.232.0.2"  # only inside the veth pair made here
# (rate, token-bucket burst). Only the rate is shaped: this machine's kernel has no sch_netem
# (`tc qdisc add ... netem` answers "Specified qdisc kind is unknown"), so no added delay; tbf
# is there. The 0.5 ms / 0.05 ms delays would add well under 1 ms per pull.
PROFILES = {"25gbit": ("25gbit", "4mb"), "1gbit": ("1gbit", "256kb"),
            "100mbit": ("100mbit", "64kb")}


def words(rng: random.Random, n: int) -> str:
    vocab = ("the a river mountain knight dragon village story long road city light sea wind "
             "stone").split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def run_profile(name: str, rate: str, burst: str, link: Link, folder: Path, ns: str, redis_url: str,
                work: Path, num_requests: int, background: int) -> dict:
    link.shape(rate, burst)
    router = Router(folder, ns, cache_dir=work, redis_url=redis_url, token="bench-token",
                    block_size=16,
                    env={"TANDEM_ROUTER_LOCAL_PREFILL_MIN_CACHED_FRACTION": "0",
                         "TANDEM_ROUTER_LOCAL_PREFILL_MAX_UNCACHED_TOKENS": "1000000"})
    stop = threading.Event()
    rng = random.Random(name)

    def background_stream(i: int) -> None:  # keeps the decode worker decoding
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                c.post(f"{router.url}/v1/completions", json={
                    "model": folder.name, "prompt": f"{name} background {i} {rng.random()}",
                    "max_tokens": 48, "temperature": 0, "ignore_eos": True})

    threads = []
    try:
        router.wait_workers(2, timeout=60)
        threads = [threading.Thread(target=background_stream, args=(i,), daemon=True)
                   for i in range(background)]
        for t in threads:
            t.start()
        time.sleep(3)
        rows = []
        with httpx.Client(timeout=300) as c:
            for i in range(num_requests):
                t0 = time.perf_counter()
                r = c.post(f"{router.url}/v1/completions", json={
                    "model": folder.name, "prompt": f"{name} request {i}: " + words(rng, 700),
                    "max_tokens": 2, "temperature": 0})
                r.raise_for_status()
                body = r.json()
                rows.append({"plan": body["tandem"]["plan"],
                             "transfer_s": body["tandem"]["transfer_s"],
                             "transfer_bytes": body["tandem"]["transfer_bytes"],
                             "prefill_s": body["tandem"]["prefill_s"],
                             "e2e_s": time.perf_counter() - t0,
                             "prompt_tokens": body["usage"]["prompt_tokens"]})
                print(json.dumps({"profile": name, **rows[-1]}), file=sys.stderr)
        metrics = router.metrics()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        router.close()
    disagg = [r for r in rows if r["plan"] == "disagg"]
    plans = {p: sum(r["plan"] == p for r in rows) for p in ("disagg", "decode_local")}
    return {
        "rate": rate, "burst": burst, "plans": plans, "rows": rows,
        "transfer_s_mean_disagg": statistics.mean(r["transfer_s"] for r in disagg)
                                  if disagg else None,
        "pull_bytes_per_s": (sum(r["transfer_bytes"] for r in disagg)
                             / sum(r["transfer_s"] for r in disagg)
                             if disagg else None),
        "e2e_s_mean": statistics.mean(r["e2e_s"] for r in rows),
        "plans_after_first": {p: sum(r["plan"] == p for r in rows[1:]) for p in plans},
        "router_hit_tokens": sum(v for k, v in metrics.items()
                                 if k.startswith("tandem_prefix_cache_hit_tokens")),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--background", type=int, default=4, help="background decode streams on D")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (ip netns, tc)", file=sys.stderr)
        return 2
    from engine.model_store import resolve_model

    folder = resolve_model(args.model)
    link = Link([ROOT_IP], NS_IP)
    redis_port = free_port()
    redis_proc = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind",
                                   f"127.0.0.1 {ROOT_IP}", "--save", "", "--appendonly", "no",
                                   "--protected-mode", "no"],
                                  stdout=subprocess.DEVNULL)
    redis_url = f"redis://{ROOT_IP}:{redis_port}/0"
    ns = f"bench-net-{uuid.uuid4().hex[:6]}"
    env = {"UCX_TLS": "tcp"}  # no shared-memory shortcut between the "hosts"
    common = ["--redis-url", redis_url, "--namespace", ns, "--threads", "1", "--max-num-seqs", "16"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        time.sleep(0.5)
        p = d = None
        try:
            p = Worker("prefill", str(folder), cache_dir=work, num_blocks=2048, block_size=16,
                       token="bench-token", host=ROOT_IP, env=env, extra=common)
            d = Worker("decode", str(folder), cache_dir=work, num_blocks=2048, block_size=16,
                       token="bench-token", host=NS_IP, netns=link.ns, env=env, extra=common)
            for name, (rate, burst) in PROFILES.items():
                results[name] = run_profile(name, rate, burst, link, folder, ns, redis_url, work,
                                            args.requests, args.background)
        finally:
            for w in (p, d):
                if w is not None:
                    w.close()
            redis_proc.kill()
            link.close()
    out = {"model": args.model, "requests_per_profile": args.requests,
           "background_streams": args.background, "profiles": results}
    write_result(ROOT / "bench" / "results" / "network.json", out)
    print(json.dumps({k: {"plans": v["plans"],
                          "transfer_s_mean_disagg": v["transfer_s_mean_disagg"],
                          "pull_bytes_per_s": v["pull_bytes_per_s"], "e2e_s_mean": v["e2e_s_mean"]}
                      for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
