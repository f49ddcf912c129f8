"""Measure a simulator cost profile (sim/profile.py) from a live cluster on this machine.

    .venv/bin/python bench/sim_profile.py [--model tiny-random] [--repeat 3] [--out bench/results/sim_profile.json]
    .venv/bin/python -m sim validate --profile-file bench/results/sim_profile.json

A fresh 1 prefill + 1 decode cluster (Redis, the real router) answers, in turn: streamed
prompts of random token ids that share no prefix (round_robin: every request disaggregated),
multi-turn chat one request at a time (kv_aware), and multi-turn chat with 4 sessions in flight
(round_robin). The profile is fitted from what the router reports per request (its `tandem`
field) and from each process's CPU time:

- router_hop_s: half the round trip of a minimal HTTP call to a worker;
- prefill_tokens_per_s: least squares of the router-observed prefill leg against prompt length
  (streamed completions of random token ids, 16 to 512);
- link_bytes_per_s, link_latency_s, block_bytes: least squares of the decode worker's pull time
  against bytes, and bytes per pulled block;
- decode_step_per_seq_s: decode time per token with 4 streams against one;
- from multi-turn chat like bench/policies.py's (other sessions), one request at a time under
  kv_aware (so both disaggregated and local plans): router_cpu_s (the router's first-token time
  less the prefill leg), prefill_fixed_s (the leg less its uncached tokens at the rate above,
  less its two hops), local_prefill_fixed_s (the same for the local plan's first token) and
  decode_step_base_s;
- host_cores: what this machine's cores are worth with all of them busy (`host_capacity`),
  which every process of the cluster shares;
- jitter: the prefill legs' relative scatter around the fitted line;
- the CPU those latencies do not show, from each process's CPU time (/proc) over multi-turn chat
  like bench/policies.py's (other sessions, 1P+1D): client_cpu_per_token_s is the load
  generator's per token; router_relay_cpu_per_token_s, prefill_io_cpu_s and decode_io_cpu_s are
  set so that the same chat, simulated, costs the router, the prefill worker and the decode worker
  the CPU they were measured to use (`close_cpu`);
- recorded, not fitted: each process's run-queue wait and switches in that chat
  (/proc/<pid>/task/*/schedstat), the OS scheduling that the simulator does not model.

With --repeat N (default 3) it measures N fresh clusters and fits their pooled figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
from clusters import ROOT  # bench/ is on sys.path when run as a script
from cpu_meter import cpu_seconds, host_capacity, own_cpu, run_queue

from loadgen import workload
from loadgen.runner import RunConfig, Runner
from sim.profile import CostProfile
from sim.simulator import Cluster
from sim.workload import Driver, SimSession, from_chat
from testing.cluster import Router, Worker

CHAT_CONCURRENCY = 4

LENGTHS = (16, 64, 128, 256, 512)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def measure(model: str, num_blocks: int, block_size: int, reps: int, work: Path) -> dict:
    from common.tokenizer import Tokenizer
    from engine.model_store import resolve_model

    folder = resolve_model(model)
    capacity = host_capacity(os.cpu_count() or 1)  # before the cluster starts: an idle machine
    ns = f"simprofile-{uuid.uuid4().hex[:6]}"
    workers = [Worker(role, str(folder), cache_dir=work, namespace=ns, num_blocks=num_blocks,
                      block_size=block_size) for role in ("prefill", "decode")]
    router = Router(folder, ns, cache_dir=work, policy="round_robin", block_size=block_size)
    rng = random.Random(0)
    tokenizer = Tokenizer(folder)
    vocab = tokenizer.vocab_size  # random prompts: no two share a block
    try:
        router.wait_workers(2)
        client = httpx.Client(base_url=router.url, timeout=120)
        # The served model's name: whatever the router lists.
        name = client.get("/v1/models").json()["data"][0]["id"]

        def use_router(policy: str) -> None:
            nonlocal router
            router.close()
            router = Router(folder, ns, cache_dir=work, policy=policy, block_size=block_size)
            router.wait_workers(2)

        def chat(sessions, concurrency: int) -> list:
            records = asyncio.run(Runner(RunConfig(f"{router.url}/v1", name, concurrency=concurrency)).run(sessions))
            if any(r.error for r in records):
                raise RuntimeError(f"calibration requests failed: {[r.error for r in records if r.error]}")
            return records

        def prompt(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        def run(p: list[int], max_tokens: int) -> dict:
            # Streamed, as the chat traffic it stands for: a token costs more streamed.
            body = {"model": name, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            timing = usage = None
            with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ev = json.loads(line[6:])
                        timing, usage = ev.get("tandem") or timing, ev.get("usage") or usage
            return {**timing, "num_prompt": len(p), "num_output": usage["completion_tokens"]}

        for _ in range(3):  # warm-up: first calls pay imports, connections, allocator growth
            run(prompt(64), 4)
        rtts = []
        for _ in range(50):
            t = time.perf_counter()
            workers[1].client.get("/health")
            rtts.append(time.perf_counter() - t)
        single = [run(prompt(n), 8) for n in LENGTHS for _ in range(reps)]
        with ThreadPoolExecutor(4) as pool:  # 4 streams decoding together
            batch = list(pool.map(lambda _: run(prompt(64), 32), range(4 * reps)))
        client.close()
        # Multi-turn chat as bench/policies.py sends it (other sessions), one request at a time:
        # the router's chat template and tokenizer, and prefills behind a cached prefix.
        # kv_aware: later turns prefill on the decode worker (the local plan), the rest disaggregated.
        use_router("kv_aware")
        records = chat(workload.multi_turn(16, turns=4, seed=2, system_words=30, user_words=8, max_tokens=8), 1)
        chat_sequential = [{**r.timing, "num_prompt": r.prompt_tokens, "num_output": r.completion_tokens}
                           for r in records]
        # CPU per request of every process, this one (the load generator) included, over the
        # same kind of chat with CHAT_CONCURRENCY sessions in flight (other sessions: seed 1),
        # every request disaggregated.
        use_router("round_robin")
        sessions = workload.multi_turn(16, turns=4, seed=1, system_words=30, user_words=8, max_tokens=8)
        pids = {"router": router.proc.pid, "prefill": workers[0].proc.pid, "decode": workers[1].proc.pid}
        cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
        # Not modelled, recorded: how long each process waited for a core, and how often it ran.
        all_pids = {**pids, "client": os.getpid()}
        queued0 = {k: run_queue(pid) for k, pid in all_pids.items()}
        self0, t0 = own_cpu(), time.perf_counter()
        # The runner alone: `tandem bench`'s report (matplotlib) would count as load CPU.
        records = chat(sessions, CHAT_CONCURRENCY)
        wall = time.perf_counter() - t0
        client_cpu = own_cpu() - self0
        queued = {k: run_queue(pid) for k, pid in all_pids.items()}
        chat = {"requests": len(records), "wall_s": wall,
                "output_tokens": sum(r.completion_tokens for r in records),
                **{f"{k}_cpu_s": cpu_seconds(pid) - cpu0[k] for k, pid in pids.items()},
                "client_cpu_s": client_cpu,
                **{f"{k}_run_queue_wait_s": queued[k][0] - queued0[k][0] for k in queued},
                **{f"{k}_switches": queued[k][1] - queued0[k][1] for k in queued},
                # What was sent, as token ids, for simulating the same run.
                "sessions": [[s.system, [list(t) for t in s.turns]] for s in from_chat(sessions, tokenizer)]}
    finally:
        router.close()
        for w in workers:
            w.close()
    return {"rtt_s": rtts, "single": single, "batch": batch, "chat_sequential": chat_sequential, "chat": chat,
            "block_size": block_size, "num_blocks": num_blocks,
            "host_cores": capacity}  # workers, router and client all share this machine


def fit(m: dict) -> CostProfile:
    hop = statistics.median(m["rtt_s"]) / 2
    single = [r for r in m["single"] if r["plan"] == "disagg"]
    a, b = fit_line([r["num_prompt"] - r["num_cached_tokens"] for r in single], [r["prefill_s"] for r in single])
    pulls = [r for r in single if r["transfer_bytes"] > 0]
    la, lb = fit_line([r["transfer_bytes"] for r in pulls], [r["transfer_s"] for r in pulls])
    bs = m["block_size"]
    # Every block the decode side lacked moved: the full ones and the partial tail.
    block_bytes = statistics.median(r["transfer_bytes"] / -(-r["num_prompt"] // bs) for r in pulls)
    mean_bw = sum(r["transfer_bytes"] for r in pulls) / sum(r["transfer_s"] for r in pulls)

    def step(rows):  # the first token came from the prefill worker
        return statistics.median(r["decode_s"] / max(r["num_output"] - 1, 1) for r in rows)

    # Spread: the prefill legs' scatter around the fitted line, relative to it.
    rel = [r["prefill_s"] / (a + b * (r["num_prompt"] - r["num_cached_tokens"])) for r in single]
    jitter = statistics.pstdev(rel) / statistics.fmean(rel)
    # The levels from chat, one request at a time: a chat request costs the router its template
    # and tokenizer, and a prefill behind a cached prefix costs more than its uncached tokens
    # (block tables, hashes and block ids in the answer); per uncached token, the slope above.
    seq = [r for r in m["chat_sequential"] if r["plan"] == "disagg"]
    router_cpu = statistics.median(r["first_token_s"] - r["prefill_s"] for r in seq)
    fixed = statistics.median(r["prefill_s"] - b * (r["num_prompt"] - r["num_cached_tokens"]) for r in seq) - 2 * hop
    # The local plan's fixed part: its first token less the router's work, two hops and the
    # uncached tokens.
    local = [r for r in m["chat_sequential"] if r["plan"] != "disagg"]
    local_fixed = statistics.median(r["first_token_s"] - router_cpu - 2 * hop - b * (r["num_prompt"] - r["num_cached_tokens"])
                                    for r in local) if local else None
    # A decode step (streamed) alone, from the chat; what each more stream adds, from 4 streams
    # against one, both of random-token prompts.
    step1 = step(seq)
    chat = m["chat"]
    profile = CostProfile(
        prefill_tokens_per_s=1 / b if b > 0 else 1e9, prefill_fixed_s=max(fixed, 1e-4),
        local_prefill_fixed_s=None if local_fixed is None else max(local_fixed, 1e-4),
        decode_step_base_s=step1, decode_step_per_seq_s=max((step(m["batch"]) - step(single)) / 3, 0.0),
        link_bytes_per_s=1 / lb if lb > 0 else mean_bw, link_latency_s=max(la, 0.0),
        block_size=bs, block_bytes=int(block_bytes), num_blocks=m["num_blocks"], router_hop_s=hop,
        host_cores=m["host_cores"], router_cpu_s=router_cpu, jitter=jitter,
        client_cpu_per_token_s=chat["client_cpu_s"] / chat["output_tokens"])
    sessions = [SimSession(system, [(user, n) for user, n in turns]) for system, turns in chat["sessions"]]
    return close_cpu(profile, sessions, chat)


def simulated_cpu(profile: CostProfile, sessions: list[SimSession]) -> dict[str, float]:
    """CPU seconds of each process in the calibration chat, simulated (1P+1D, round robin)."""
    cluster = Cluster(profile, 1, 1, "round_robin")
    Driver(cluster, sessions, concurrency=CHAT_CONCURRENCY)
    cluster.clock.run()
    busy = {name: t.busy_s for name, t in cluster.threads().items()}
    return {"router": busy["router"], "prefill": busy["prefill-0"], "decode": busy["decode-0"]}


def close_cpu(profile: CostProfile, sessions: list[SimSession], chat: dict, rounds: int = 4) -> CostProfile:
    """Adds the CPU that the latency fits miss (the router's relaying, each worker's HTTP, leases,
    pulls and events), so that the calibration chat, simulated, costs each process what it was
    measured to. The router's extra is per token it relays (on the token's path); each worker's
    per request, after what the request waits for. A few rounds: the extra work changes the
    decode batches, and with them the steps' cost."""
    num_requests, num_tokens = chat["requests"], chat["output_tokens"]
    for _ in range(rounds):
        sim = simulated_cpu(profile, sessions)
        profile = replace(
            profile,
            router_relay_cpu_per_token_s=max(profile.router_relay_cpu_per_token_s
                                             + (chat["router_cpu_s"] - sim["router"]) / num_tokens, 0.0),
            prefill_io_cpu_s=max(profile.prefill_io_cpu_s + (chat["prefill_cpu_s"] - sim["prefill"]) / num_requests, 0.0),
            decode_io_cpu_s=max(profile.decode_io_cpu_s + (chat["decode_cpu_s"] - sim["decode"]) / num_requests, 0.0))
    return profile


def pool(runs: list[dict]) -> dict:
    """Several measurements as one: every request's figures together, each process's CPU over the
    calibration chat averaged (this machine's speed drifts by tens of percent between runs)."""
    m = dict(runs[0])
    for key in ("rtt_s", "single", "batch", "chat_sequential"):
        m[key] = [row for run in runs for row in run[key]]
    m["host_cores"] = statistics.median(run["host_cores"] for run in runs)
    m["chat"] = {**runs[0]["chat"], **{key: statistics.fmean(run["chat"][key] for run in runs)
                                       for key in runs[0]["chat"] if key.endswith(("_s", "_switches")) or key == "output_tokens"}}
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="measure on this many fresh clusters, pooled")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_profile.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = pool([measure(args.model, args.num_blocks, args.block_size, args.reps, Path(tmp))
                  for _ in range(args.repeat)])
    profile = fit(m)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    (out.with_suffix(".measurements.json")).write_text(json.dumps(m, indent=2) + "\n")
    print(json.dumps(profile.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
