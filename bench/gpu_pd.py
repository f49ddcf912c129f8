"""A P/D pair on one GPU behind the router: answers token-identical to the one-process engine,
then warm per-request medians of the KV pull against the prefill it saves, with concurrency.

    python bench/gpu_pd.py --tokenizer DIR [--shape smollm2-1.7b] [--out pd.json]
    .venv/bin/python bench/gpu_pd.py --device cpu --shape tiny --smoke   # the script, on CPU

Builds a model of a real shape with seeded random weights on the GPU (no download; the
tokenizer comes from a real model folder: SmolLM2's, whose vocabulary the shape shares), answers
prompts of several lengths with the offline engine (`LLM`, greedy), then starts a prefill and a
decode worker on the same GPU (NIXL between them) and a router with the two as static workers.

1. Correctness: the same prompts through `/v1/completions`, one at a time, texts compared.
2. Warm-up: `--warmup` requests, as in 3, not counted.
3. Timed: `--num-requests` fresh prompts (lengths cycled; no prefix shared, so each is
   prefilled and pulled), `--concurrency` at a time, so that pulls meet decode steps of other
   requests. Per request, from the answer's `tandem` field: `prefill_s` (the router's prefill
   leg), `transfer_s` and `transfer_bytes` (the decode worker's pull), `first_token_s`,
   `total_s`; their medians by prompt length and overall, and the median of each request's
   pull over its prefill. From the workers' /metrics, over the timed requests alone:
   `tandem_kv_transfer_seconds` (decode) and `tandem_prefill_time_seconds` (prefill), means.
   Whether a timed answer equals the offline engine's is counted, not required: bf16 results
   may differ where the batch around a request differs.

Needs no Redis. Exit status 0 when the correctness pass is identical, every timed request
answered 200 and the timed requests pulled KV (`plans` counts the router's plans: a short prompt
may be prefilled where it is decoded).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from engine.tiny import build_tiny_random  # noqa: E402
from testing.cluster import Router, Worker  # noqa: E402
from testing.metrics import series_sum  # noqa: E402

# Few CUDA-graph buckets to capture at start (the engine and both workers); >= the concurrency.
MAX_NUM_SEQS = 8
TIMING = ("prefill_s", "transfer_s", "first_token_s", "total_s")


def reference(folder: Path, prompts: list[list[int]], max_tokens: int, device: str,
              dtype: str) -> list[str]:
    """The offline engine's greedy texts, one prompt at a time."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(str(folder), device=device, dtype=dtype, num_blocks=1024, block_size=16,
              max_num_seqs=MAX_NUM_SEQS)
    texts = [llm.generate(p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                            ignore_eos=True))[0].text for p in prompts]
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return texts


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy completion through the router: status, text, the `tandem` field's timing and
    the client's wall time."""
    t = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300) as client:
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                 "max_tokens": max_tokens, "temperature": 0,
                                                 "ignore_eos": True})
    row = {"prompt_tokens": len(prompt), "status": r.status_code,
           "client_s": round(time.perf_counter() - t, 5)}
    body = r.json()
    if r.status_code != 200:
        return row | {"error": body}
    timing = body.get("tandem") or {}
    return row | {"text": body["choices"][0]["text"], "plan": timing.get("plan"),
                  "transfer_bytes": timing.get("transfer_bytes"),
                  **{k: timing.get(k) for k in TIMING}}


def medians(rows: list[dict]) -> dict:
    """Median of each timing over `rows` (ms; prefill and pull over the requests that pulled
    alone), and of each request's pull over its prefill."""
    pulled = [r for r in rows if r.get("transfer_bytes")]
    out: dict = {"requests": len(rows), "pulled": len(pulled)}
    for k in TIMING:
        values = [r[k] for r in (pulled if k in ("prefill_s", "transfer_s") else rows)
                  if r.get(k) is not None]
        out[f"{k.removesuffix('_s')}_ms_p50"] = (round(1e3 * statistics.median(values), 3)
                                                 if values else None)
    ratios = [r["transfer_s"] / r["prefill_s"] for r in rows
              if r.get("transfer_s") and r.get("prefill_s")]
    out["pull_over_prefill_p50"] = round(statistics.median(ratios), 4) if ratios else None
    return out


def worker_means(d: Worker, p: Worker, before: tuple[dict, dict] | None) -> dict:
    """The pull and prefill means from the workers' metrics, since `before` (their scrapes)."""
    dm, pm = d.metrics(), p.metrics()

    def delta(m: dict, old: dict | None, name: str) -> float:
        return series_sum(m, name) - (series_sum(old, name) if old is not None else 0.0)

    bd, bp = before if before is not None else (None, None)
    pulls = delta(dm, bd, "tandem_kv_transfer_seconds_count")
    pull_s = delta(dm, bd, "tandem_kv_transfer_seconds_sum")
    prefills = delta(pm, bp, "tandem_prefill_time_seconds_count")
    prefill_s = delta(pm, bp, "tandem_prefill_time_seconds_sum")
    out = {"pulls": pulls, "pull_mean_ms": round(1e3 * pull_s / pulls, 3) if pulls else None,
           "pull_bytes": delta(dm, bd, "tandem_kv_transfer_bytes_total"),
           "prefills": prefills,
           "prefill_mean_ms": round(1e3 * prefill_s / prefills, 3) if prefills else None,
           "transport_labels": sorted({k.split('transport="')[1].split('"')[0] for k in dm
                                       if k.startswith("tandem_kv_transfer_seconds_count")})}
    if pulls and prefills:
        out["pull_over_prefill_mean"] = round((pull_s / pulls) / (prefill_s / prefills), 4)
    return out


def timed(router: Router, model: str, prompts: list[list[int]], want: list[str],
          max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    """Every prompt through the router, `concurrency` at a time; rows in prompt order, and the
    wall time of the whole batch."""
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda p: complete(router.url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t
    for row, text in zip(rows, want, strict=True):
        row["identical"] = row.pop("text", None) == text
    return rows, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", default=None, help="a model folder whose tokenizer to use "
                    "(default: the byte-level tiny one, for --shape tiny)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="2000,500,64", help="prompt lengths in tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=36, help="timed requests")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4, help="requests before the timed ones")
    ap.add_argument("--smoke", action="store_true", help="a few short requests (the script on "
                    "CPU: --device cpu --shape tiny)")
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_pd.json"))
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.max_tokens, args.num_requests, args.warmup = "40,12", 4, 4, 1
        args.concurrency = min(args.concurrency, 2)
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype = "float32"

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tandem-gpu-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = SHAPES[args.shape]
    t0 = time.perf_counter()
    folder = build_tiny_random(workdir / f"random-{args.shape}", seed=0, config=config,
                               device=args.device, dtype=args.dtype,
                               tokenizer_from=Path(args.tokenizer) if args.tokenizer else None)
    result: dict = {"shape": args.shape, "device": args.device, "dtype": args.dtype,
                    "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                    "warmup": args.warmup, "build_s": round(time.perf_counter() - t0, 1)}
    rng = random.Random(0)
    vocab = min(config.get("vocab_size", 320), 40000)
    lengths = [int(x) for x in args.lengths.split(",")]

    def make(n: int) -> list[list[int]]:  # fresh prompts: no prefix shared with any other
        return [[rng.randrange(100 if vocab > 1000 else 0, vocab - 64)
                 for _ in range(lengths[i % len(lengths)])] for i in range(n)]

    check, warm, prompts = make(len(lengths)), make(args.warmup), make(args.num_requests)
    want = reference(folder, check + prompts, args.max_tokens, args.device, args.dtype)

    flags = ["--device", args.device, "--dtype", args.dtype, "--transport", args.transport,
             "--lease-seconds", "10", "--max-num-seqs", str(MAX_NUM_SEQS)]
    num_blocks = 2048 if args.device == "cuda" else 512
    workers: list[Worker] = []
    router = None
    ok = False
    try:
        for role in ("prefill", "decode"):
            workers.append(Worker(role, str(folder), cache_dir=workdir, extra=flags,
                                  num_blocks=num_blocks, block_size=16))
        p, d = workers
        router = Router(folder, None, cache_dir=workdir, block_size=16, redis_url=None,
                        extra=["--worker", f"prefill={p.url}", "--worker", f"decode={d.url}"])
        router.wait_workers(2, timeout=120)
        rows, _ = timed(router, folder.name, check, want[: len(check)], args.max_tokens, 1)
        result |= {"requests": rows, "all_identical": all(r["identical"] for r in rows),
                   **worker_means(d, p, None)}
        write_result(args.out, result)
        if warm:
            timed(router, folder.name, warm, [""] * len(warm), args.max_tokens, args.concurrency)
        before = (d.metrics(), p.metrics())
        rows, wall = timed(router, folder.name, prompts, want[len(check):], args.max_tokens,
                           args.concurrency)
        by_length = {str(n): medians([r for r in rows if r["prompt_tokens"] == n])
                     for n in lengths}
        ok_rows = [r for r in rows if r["status"] == 200]
        plans: dict[str, int] = {}
        for r in ok_rows:
            plans[str(r.get("plan"))] = plans.get(str(r.get("plan")), 0) + 1
        result["warm"] = {
            "requests": len(rows), "ok": len(ok_rows), "wall_s": round(wall, 3),
            "requests_per_s": round(len(rows) / wall, 2), "plans": plans,
            "identical": sum(r["identical"] for r in rows),
            "medians": medians(ok_rows), "medians_by_length": by_length,
            **worker_means(d, p, before), "rows": rows}
        ok = result["all_identical"] and len(ok_rows) == len(rows) and result["warm"]["pulls"] > 0
    finally:
        for proc in [router, *workers]:
            if proc is not None:
                proc.close()
    result["passed"] = ok
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "warm"} | {
        "warm": {k: v for k, v in result.get("warm", {}).items() if k != "rows"}}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
