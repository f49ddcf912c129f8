"""Measure a simulator cost profile (sim/profile.py) from a live cluster on this machine.

    .venv/bin/python bench/sim_profile.py [--model tiny-random] [--repeat 3]
                                          [--out bench/results/sim_profile.json]
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
  the CPU they were measured to use (`close_cpu`, bench/sim_fit.py);
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
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from clusters import ROOT  # bench/ is on sys.path when run as a script
from cpu_meter import cpu_seconds, host_capacity, own_cpu, run_queue
from provenance import write_result
from sim_fit import CHAT_CONCURRENCY, fit, pool

from loadgen import workload
from loadgen.runner import RunConfig, Runner
from sim.workload import from_chat
from testing.cluster import Router, Worker

LENGTHS = (16, 64, 128, 256, 512)


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
            records = asyncio.run(Runner(RunConfig(f"{router.url}/v1", name,
                                                   concurrency=concurrency)).run(sessions))
            if any(r.error for r in records):
                raise RuntimeError("calibration requests failed: "
                                   f"{[r.error for r in records if r.error]}")
            return records

        def prompt(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        def run(p: list[int], max_tokens: int) -> dict:
            # Streamed, as the chat traffic it stands for: a token costs more streamed.
            body = {"model": name, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
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
        # Multi-turn chat as bench/policies.py sends it (other sessions), one request at a time: the
        # router's chat template and tokenizer, and prefills behind a cached prefix. kv_aware: later
        # turns prefill on the decode worker (the local plan), the rest disaggregated.
        use_router("kv_aware")
        records = chat(workload.multi_turn(16, turns=4, seed=2, system_words=30, user_words=8,
                                           max_tokens=8), 1)
        chat_sequential = [{**r.timing, "num_prompt": r.prompt_tokens,
                            "num_output": r.completion_tokens}
                           for r in records]
        # CPU per request of every process, this one (the load generator) included, over the
        # same kind of chat with CHAT_CONCURRENCY sessions in flight (other sessions: seed 1),
        # every request disaggregated.
        use_router("round_robin")
        sessions = workload.multi_turn(16, turns=4, seed=1, system_words=30, user_words=8,
                                       max_tokens=8)
        pids = {"router": router.proc.pid, "prefill": workers[0].proc.pid,
                "decode": workers[1].proc.pid}
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
                "sessions": [[s.system, [list(t) for t in s.turns]]
                             for s in from_chat(sessions, tokenizer)]}
    finally:
        router.close()
        for w in workers:
            w.close()
    return {"rtt_s": rtts, "single": single, "batch": batch, "chat_sequential": chat_sequential,
            "chat": chat, "block_size": block_size, "num_blocks": num_blocks,
            "host_cores": capacity}  # workers, router and client all share this machine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3,
                    help="measure on this many fresh clusters, pooled")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_profile.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = pool([measure(args.model, args.num_blocks, args.block_size, args.reps, Path(tmp))
                  for _ in range(args.repeat)])
    profile = fit(m)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    # The profile file holds CostProfile's fields alone (sim.profile.load refuses any other
    # key): the provenance goes with the measurements it was fitted from.
    write_result(out.with_suffix(".measurements.json"), m)
    print(json.dumps(profile.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
