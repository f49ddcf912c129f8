"""Measure a simulator cost profile (sim/profile.py) from a live cluster on this machine.

    .venv/bin/python bench/sim_profile.py [--model tiny-random] [--out bench/results/sim_profile.json]
    .venv/bin/python -m sim validate --profile-file bench/results/sim_profile.json

A fresh 1 prefill + 1 decode cluster (Redis, real router, round_robin so every request is
disaggregated) answers token-id prompts that share no prefix, and the profile is fitted from
what the router reports per request (its `tandem` field):

- router_hop_s: half the round trip of a minimal HTTP call to a worker;
- prefill_tokens_per_s, prefill_fixed_s: least squares of the router-observed prefill leg
  against prompt length (the fixed part less the leg's two hops);
- link_bytes_per_s, link_latency_s, block_bytes: least squares of the decode worker's pull time
  against bytes, and bytes per pulled block;
- decode_step_base_s, decode_step_per_seq_s: decode time per token alone, and with 4 streams;
- host_cores: this machine's cores, which every process of the cluster shares;
- router_cpu_s: the router's first-token time less the prefill leg;
- background_cpu_per_token_s: the rest of the router's CPU and the load generator's, per streamed
  token, over multi-turn chat like bench/policies.py's (other sessions);
- worker_io_cpu_per_token_s: the decode worker's CPU in that run beyond its decode steps;
- jitter: the prefill legs' relative scatter around the fitted line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from clusters import ROOT  # bench/ is on sys.path when run as a script
from router_overhead import cpu_seconds

from loadgen import workload
from loadgen.runner import RunConfig, Runner
from sim.profile import CostProfile
from tests.worker.cluster import Router, Worker

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
    ns = f"simprofile-{uuid.uuid4().hex[:6]}"
    workers = [Worker(role, str(folder), cache_dir=work, namespace=ns, num_blocks=num_blocks,
                      block_size=block_size) for role in ("prefill", "decode")]
    router = Router(folder, ns, cache_dir=work, policy="round_robin", block_size=block_size)
    rng = random.Random(0)
    vocab = Tokenizer(folder).vocab_size  # random prompts: no two share a block
    try:
        router.wait_workers(2)
        client = httpx.Client(base_url=router.url, timeout=120)
        # The served model's name: whatever the router lists.
        name = client.get("/v1/models").json()["data"][0]["id"]

        def prompt(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        def run(p: list[int], max_tokens: int) -> dict:
            r = client.post("/v1/completions", json={"model": name, "prompt": p, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
            body = r.json()
            return {**body["tandem"], "num_prompt": len(p), "num_output": body["usage"]["completion_tokens"]}

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
        # CPU per request of the router and of the client (this process), over streamed
        # multi-turn chat as bench/policies.py sends it (other sessions: seed 1).
        sessions = workload.multi_turn(8, turns=4, seed=1, system_words=30, user_words=8, max_tokens=8)
        decode_pid = workers[1].proc.pid
        cpu0, self0, t0 = cpu_seconds(router.proc.pid), _own_cpu(), time.perf_counter()
        dcpu0 = cpu_seconds(decode_pid)
        # The runner alone: `tandem bench`'s report (matplotlib) would count as load CPU.
        records = asyncio.run(Runner(RunConfig(f"{router.url}/v1", name, concurrency=4)).run(sessions))
        wall = time.perf_counter() - t0
        if any(r.error for r in records):
            raise RuntimeError(f"calibration requests failed: {[r.error for r in records if r.error]}")
        chat = {"requests": len(records), "wall_s": wall,
                "output_tokens": sum(r.completion_tokens for r in records),
                "router_cpu_s": cpu_seconds(router.proc.pid) - cpu0, "client_cpu_s": _own_cpu() - self0,
                "decode_cpu_s": cpu_seconds(decode_pid) - dcpu0}
    finally:
        router.close()
        for w in workers:
            w.close()
    return {"rtt_s": rtts, "single": single, "batch": batch, "chat": chat,
            "block_size": block_size, "num_blocks": num_blocks,
            "host_cores": os.cpu_count()}  # workers, router and client all share this machine


def _own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


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

    step1, step4 = step(single), step(m["batch"])
    # Spread: the prefill legs' scatter around the fitted line, relative to it.
    rel = [r["prefill_s"] / (a + b * (r["num_prompt"] - r["num_cached_tokens"])) for r in single]
    jitter = statistics.pstdev(rel) / statistics.fmean(rel)
    # Router work before the prefill call: its first-token time less the prefill leg.
    router_cpu = statistics.median(r["first_token_s"] - r["prefill_s"] for r in single)
    # The rest of the router's CPU (less the three hops the sim charges: call P, call D, back)
    # and the load generator's, per streamed token.
    chat = m["chat"]
    relay = chat["router_cpu_s"] + chat["client_cpu_s"] - chat["requests"] * (router_cpu + 3 * hop)
    return CostProfile(
        prefill_tokens_per_s=1 / b if b > 0 else 1e9, prefill_fixed_s=max(a - 2 * hop, 1e-4),
        decode_step_base_s=step1, decode_step_per_seq_s=max((step4 - step1) / 3, 0.0),
        link_bytes_per_s=1 / lb if lb > 0 else mean_bw, link_latency_s=max(la, 0.0),
        block_size=bs, block_bytes=int(block_bytes), num_blocks=m["num_blocks"], router_hop_s=hop,
        host_cores=m["host_cores"], router_cpu_s=router_cpu,
        background_cpu_per_token_s=max(relay, 0.0) / chat["output_tokens"], jitter=jitter,
        # The decode worker's CPU beyond its steps (at the batch-1 step cost: an upper bound
        # on what the steps took), per token it streamed after the first.
        worker_io_cpu_per_token_s=max(chat["decode_cpu_s"] / (chat["output_tokens"] - chat["requests"])
                                      - step1, 0.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sim_profile.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(args.model, args.num_blocks, args.block_size, args.reps, Path(tmp))
    profile = fit(m)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    (out.with_suffix(".measurements.json")).write_text(json.dumps(m, indent=2) + "\n")
    print(json.dumps(profile.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
