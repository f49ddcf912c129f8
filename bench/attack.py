"""A victim's latency while hostile clients attack the cluster (issue 28).

    .venv/bin/python bench/attack.py [--requests 40] [--min-phase-s 10] [--attacks a,b]
                                     [--out bench/results/attack.json]

One real cluster (tiny-random: a prefill worker, a decode worker, a router, Redis) serves a
victim that sends completions back to back (8 tokens each; at least `--requests`, for at least
`--min-phase-s`, so a phase spans an attack's cycle of connect, stall and cut), first idle, then
while each attack runs (at most 50 connections; each attack alone):
  grammar_bombs  8 clients loop `((a{1000}){1000})`-style constraints with n=8 (refused: 400)
  n_orphans      8 clients loop n=8 requests whose last choice is invalid (seed overflow) and
                 1,500 tokens each (refused before any choice starts)
  slow_readers   8 clients open n=8 streams with top_logprobs 20 and never read (cut after the
                 stream write deadline; each reconnects once it sees the cut, or once the
                 deadline has passed: a FIN queued behind the unread stream never arrives)
  slowloris      40 connections send headers a byte a second (closed at the header deadline,
                 reconnecting)
  heavy_streams  not an attack, not run unless named: 8 clients loop n=8 streams of 1,500
                 tokens and read them (64 sequences: every slot of the decode worker's batch);
                 `--worker-arg=--scheduling-policy=fcfs` for the batch without sharing
The victim and the attackers are told apart as a gateway tells clients apart: by API key
(`victim-key`, `attacker-key`), or with `--identity address` by address (no keys: the victim
connects from 127.0.0.2, the attackers from 127.0.0.1 with a new X-Forwarded-For on every
request; `--router-arg=--forwarded-allow-ips=127.0.0.1` trusts that header, as uvicorn's
default once did), and the router runs with per-client limits
(`--client-max-requests`, `--client-max-running`, `--client-requests-per-s`; 0 turns one off
to compare). Each attack runs
in a process of its own, so the attackers' threads never share the victim's interpreter (and
GIL) and the figures are the router's.

JSON: victim p50/p99 (ms) and statuses per phase, the ratio against idle, what the attackers
got back, the router's per-client settings and the load average. Not a test: figures depend on
the machine (on a shared one, compare the ratios of one run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.attackers import ATTACKS, DEFAULT_ATTACKS, WRITE_TIMEOUT_S, attacker_process  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from testing.cluster import Router, Worker  # noqa: E402 - the same process helpers as the tests

MODEL = "tiny-random"
VICTIM = {"Authorization": "Bearer victim-key"}
VICTIM_ADDRESS = None  # --identity address: 127.0.0.2


def victim(url: str, n: int, min_s: float = 0.0) -> tuple[list[float], dict[int, int]]:
    ms, statuses = [], {}
    end = time.monotonic() + min_s
    transport = httpx.HTTPTransport(local_address=VICTIM_ADDRESS) if VICTIM_ADDRESS else None
    with httpx.Client(timeout=120, headers=VICTIM, transport=transport) as c:
        i = 0
        while i < n or time.monotonic() < end:
            i += 1
            t0 = time.perf_counter()
            r = c.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": f"victim {i}",
                                                     "max_tokens": 8, "temperature": 0})
            ms.append((time.perf_counter() - t0) * 1000)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    return ms, statuses


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1), "max_ms": round(max(ms), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40, help="victim requests per phase (at least)")
    ap.add_argument("--min-phase-s", type=float, default=10.0,
                    help="victim seconds per phase (at least)")
    ap.add_argument("--attacks", default=DEFAULT_ATTACKS, help="which, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attack.json"))
    ap.add_argument("--client-max-requests", type=int, default=2, help="0: no limit")
    ap.add_argument("--client-max-running", type=int, default=8, help="0: no limit")
    ap.add_argument("--client-requests-per-s", type=float, default=20.0, help="0: no limit")
    ap.add_argument("--router-arg", action="append", default=[], help="more router flags "
                    "(repeat; e.g. --router-arg=--send-buffer-bytes=65536)")
    ap.add_argument("--worker-arg", action="append", default=[], help="more flags of both workers")
    ap.add_argument("--identity", choices=("key", "address"), default="key",
                    help="how the router tells the victim from the attackers")
    args = ap.parse_args()
    global VICTIM_ADDRESS
    by_address = args.identity == "address"
    if by_address:
        VICTIM.clear()
        VICTIM_ADDRESS = "127.0.0.2"
    keys = [] if by_address else ["--api-key", "victim-key", "--api-key", "attacker-key"]
    limits = []
    if args.client_max_requests:
        limits += ["--client-max-requests", str(args.client_max_requests)]
    if args.client_max_running:
        limits += ["--client-max-running", str(args.client_max_running)]
    if args.client_requests_per_s:
        limits += ["--client-requests-per-s", str(args.client_requests_per_s)]
    from engine.tiny import build_tiny_random  # torch: not for the attackers' processes

    work = Path(args.out).parent
    work.mkdir(parents=True, exist_ok=True)
    folder = build_tiny_random(work / "models" / MODEL)
    ns = f"attack-{uuid.uuid4().hex[:6]}"
    procs: list = []
    try:
        procs.append(Worker("prefill", str(folder), cache_dir=work, namespace=ns, num_blocks=2048,
                            extra=args.worker_arg))
        procs.append(Worker("decode", str(folder), cache_dir=work, namespace=ns, num_blocks=2048,
                            extra=args.worker_arg))
        router = Router(folder, ns, cache_dir=work, extra=[
            "--stream-write-timeout-s", str(WRITE_TIMEOUT_S), "--header-timeout-s", "5",
            *keys, *limits, *args.router_arg])
        procs.append(router)
        router.wait_workers(2)
        victim(router.url, 5)  # warm up
        ms, statuses = victim(router.url, args.requests, args.min_phase_s)
        result = {"victim_requests": args.requests, "min_phase_s": args.min_phase_s,
                  "router_limits": limits, "router_args": args.router_arg,
                  "identity": args.identity,
                  "worker_args": args.worker_arg,
                  "load_average_start": os.getloadavg(),
                  "idle": {**summary(ms), "requests": len(ms), "statuses": statuses}}
        print("idle", result["idle"], flush=True)
        mp = multiprocessing.get_context("spawn")
        for name in args.attacks.split(","):
            clients = ATTACKS[name][1]
            stop, out = mp.Event(), mp.Queue()
            proc = mp.Process(target=attacker_process,
                              args=(name, router.url, stop, out, by_address))
            proc.start()
            time.sleep(4.0)  # the attack is under way (the process imports, then connects)
            ms, statuses = victim(router.url, args.requests, args.min_phase_s)
            stop.set()
            got = out.get(timeout=60)
            proc.join(30)
            row = {**summary(ms), "requests": len(ms), "statuses": statuses,
                   "attack_connections": clients,
                   "p50_vs_idle": round(summary(ms)["p50_ms"] / result["idle"]["p50_ms"], 2),
                   "p99_vs_idle": round(summary(ms)["p99_ms"] / result["idle"]["p99_ms"], 2)}
            if name in ("grammar_bombs", "n_orphans", "heavy_streams"):
                row["attacker_statuses"] = {str(s): got.count(s) for s in sorted(set(got))}
            else:
                seen = [x for x in got if x is not None]
                row["attacker_streams_ended"] = len(got)  # cut seen, or past the deadline
                row["attacker_cut_after_s"] = (summary([x * 1000 for x in seen])
                                               if len(seen) > 1 else seen)
            result[name] = row
            print(name, row, flush=True)
            time.sleep(3.0)  # what the attack left running drains before the next phase
        result["load_average_end"] = os.getloadavg()
    finally:
        for p in reversed(procs):
            p.close()
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
