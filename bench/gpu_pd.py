"""A P/D pair on one GPU behind the router: answers token-identical to the one-process engine,
and the KV pull far below the prefill it saves.

    python bench/gpu_pd.py --tokenizer DIR [--shape smollm2-1.7b] [--out pd.json]

Builds a model of a real shape with seeded random weights on the GPU (no download; the
tokenizer comes from a real model folder: SmolLM2's, whose vocabulary the shape shares), answers
prompts of several lengths with the offline engine (`LLM`, greedy), then starts a prefill and a
decode worker on the same GPU (NIXL between them) and a router with the two as static workers,
sends the same prompts through `/v1/completions` and compares the texts. Reads
`tandem_kv_transfer_seconds` (decode worker) and `tandem_prefill_time_seconds` (prefill worker)
from their /metrics. Needs no Redis. Also runs on CPU (`--device cpu --shape tiny`) to prove the
script end to end.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from engine.tiny import build_tiny_random  # noqa: E402
from testing.cluster import Router, Worker  # noqa: E402
from testing.metrics import series_sum  # noqa: E402

# One request at a time: few CUDA-graph buckets to capture at start (the engine and both workers).
MAX_NUM_SEQS = 8


def reference_texts(folder: Path, prompts: list[list[int]], max_tokens: int, device: str,
                    dtype: str) -> tuple[list[str], list[list[int]]]:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(str(folder), device=device, dtype=dtype, num_blocks=1024, block_size=16,
              max_num_seqs=MAX_NUM_SEQS)
    outs = [llm.generate(p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True))[0] for p in prompts]
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return [o.text for o in outs], [list(o.token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", default=None, help="a model folder whose tokenizer to use "
                    "(default: the byte-level tiny one, for --shape tiny)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="2000,500,64", help="prompt lengths in tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_pd.json"))
    args = ap.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tandem-gpu-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = SHAPES[args.shape]
    t0 = time.perf_counter()
    folder = build_tiny_random(workdir / f"random-{args.shape}", seed=0, config=config,
                               device=args.device, dtype=args.dtype,
                               tokenizer_from=Path(args.tokenizer) if args.tokenizer else None)
    result: dict = {"shape": args.shape, "device": args.device, "dtype": args.dtype,
                    "build_s": round(time.perf_counter() - t0, 1)}
    rng = random.Random(0)
    vocab = min(config.get("vocab_size", 320), 40000)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = [[rng.randrange(100 if vocab > 1000 else 0, vocab - 64) for _ in range(n)]
               for n in lengths]
    want, want_ids = reference_texts(folder, prompts, args.max_tokens, args.device, args.dtype)

    flags = ["--device", args.device, "--dtype", args.dtype, "--transport", args.transport,
             "--lease-seconds", "10", "--max-num-seqs", str(MAX_NUM_SEQS)]
    num_blocks = 2048 if args.device == "cuda" else 256
    workers: list[Worker] = []
    router = None
    rows = []
    try:
        for role in ("prefill", "decode"):
            workers.append(Worker(role, str(folder), cache_dir=workdir, extra=flags,
                                  num_blocks=num_blocks, block_size=16))
        p, d = workers
        router = Router(folder, None, cache_dir=workdir, block_size=16, redis_url=None,
                        extra=["--worker", f"prefill={p.url}", "--worker", f"decode={d.url}"])
        router.wait_workers(2, timeout=120)
        for prompt, text, ids in zip(prompts, want, want_ids, strict=True):
            r = router.client.post("/v1/completions", json={
                "model": folder.name, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True}, timeout=120)
            body = r.json()
            got = body["choices"][0]["text"] if r.status_code == 200 else None
            rows.append({"prompt_tokens": len(prompt), "status": r.status_code,
                         "identical": got == text, "tokens": len(ids),
                         "plan": (body.get("tandem") or {}).get("plan") if r.status_code == 200
                         else body})
        dm, pm = d.metrics(), p.metrics()
        pulls = series_sum(dm, "tandem_kv_transfer_seconds_count")
        pull_s = series_sum(dm, "tandem_kv_transfer_seconds_sum")
        prefills = series_sum(pm, "tandem_prefill_time_seconds_count")
        prefill_s = series_sum(pm, "tandem_prefill_time_seconds_sum")
        labels = sorted({k.split('transport="')[1].split('"')[0] for k in dm
                         if k.startswith("tandem_kv_transfer_seconds_count")})
        result |= {
            "requests": rows,
            "all_identical": all(r["identical"] for r in rows),
            "pulls": pulls, "pull_mean_ms": round(1e3 * pull_s / pulls, 3) if pulls else None,
            "pull_bytes": series_sum(dm, "tandem_kv_transfer_bytes_total"),
            "transport_labels": labels,
            "prefills": prefills,
            "prefill_mean_ms": round(1e3 * prefill_s / prefills, 3) if prefills else None,
        }
        if pulls and prefills:
            result["pull_over_prefill"] = round((pull_s / pulls) / (prefill_s / prefills), 4)
    finally:
        for proc in [router, *workers]:
            if proc is not None:
                proc.close()
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0 if result.get("all_identical") else 1


if __name__ == "__main__":
    sys.exit(main())
