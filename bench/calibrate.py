"""Measure a simulator cost profile (sim/profile.py) on a real local cluster.

    .venv/bin/python bench/calibrate.py [--model tiny-random] [--block-size 4]

One prefill and one decode worker behind the router. Measured, each from the router's own
per-request timing (the `tandem` field) or the client's clock:
- prefill: the prefill leg's seconds at two prompt lengths (fresh prompts, no cache hits) give
  the fixed cost and tokens/s by a straight line;
- router hop: client TTFT minus the router's prefill-leg seconds;
- decode step: inter-token latency of 1 stream and of 8 concurrent streams on the one decoder;
- link: the decode worker's pulls (bytes, seconds) at two prompt lengths, by a straight line.
JSON: bench/results/profile-{model}.json, loadable by `python -m sim ... --profile-file`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from clusters import ROOT  # bench/ is on sys.path when run as a script

from tests.worker.cluster import Router, Worker


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def stream(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, final = [], None
    usage = None
    with client.stream("POST", url, json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True, "stream": True,
                                          "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for raw in r.iter_lines():
            if not raw.startswith("data:") or raw.endswith("[DONE]"):
                continue
            chunk = json.loads(raw[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk.get("tandem"):
                final = chunk["tandem"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
    return {"ttft": times[0], "itl": [b - a for a, b in zip(times, times[1:], strict=False)], "tandem": final,
            "prompt_tokens": usage["prompt_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    from engine.model_store import resolve_model

    folder = resolve_model(args.model)
    ns = f"calib-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        p = Worker("prefill", str(folder), cache_dir=work, namespace=ns, num_blocks=4096, block_size=args.block_size)
        d = Worker("decode", str(folder), cache_dir=work, namespace=ns, num_blocks=4096, block_size=args.block_size)
        # Only disaggregated plans: every request crosses both legs and the link.
        r = Router(folder, ns, cache_dir=work, block_size=args.block_size,
                   env={"TANDEM_ROUTER_CONDITIONAL_DISAGG": "false"})
        try:
            r.wait_workers(2)
            url = f"{r.url}/v1/completions"
            words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
            n = 0

            def fresh(num_words: int) -> str:
                nonlocal n
                n += 1
                return f"{n} " + " ".join(words[(n + i) % len(words)] for i in range(num_words))

            with httpx.Client(timeout=300) as c:
                stream(c, url, folder.name, fresh(8), 4)  # warm-up
                rows = []
                for num_words in (20, 400):
                    for _ in range(args.repeats):
                        out = stream(c, url, folder.name, fresh(num_words), 3)
                        rows.append((num_words, out))
                decode1 = [x for _ in range(3) for x in stream(c, url, folder.name, fresh(10), 40)["itl"]]
            with cf.ThreadPoolExecutor(8) as pool, httpx.Client(timeout=300) as c:
                outs = list(pool.map(lambda i: stream(c, url, folder.name, fresh(10), 60), range(8)))
            decode8 = [x for o in outs for x in o["itl"][10:-10]]  # the middle, when all 8 run
            m = d.metrics()
        finally:
            r.close()
            p.close()
            d.close()
    prefill_fixed, prefill_per_token = line([o["prompt_tokens"] for _, o in rows],
                                            [o["tandem"]["prefill_s"] for _, o in rows])
    hop = statistics.median(o["ttft"] - o["tandem"]["prefill_s"] for _, o in rows)
    pulls = [(o["tandem"]["transfer_bytes"], o["tandem"]["transfer_s"]) for _, o in rows]
    link_latency, link_s_per_byte = line([b for b, _ in pulls], [t for _, t in pulls])
    num_bytes = sum(v for k, v in m.items() if k.startswith("tandem_kv_transfer_bytes_total"))
    num_blocks = sum(v for k, v in m.items() if k.startswith("tandem_kv_transfer_blocks_total"))
    step1, step8 = statistics.median(decode1), statistics.median(decode8)
    profile = {
        "prefill_tokens_per_s": 1 / max(prefill_per_token, 1e-7),
        "prefill_fixed_s": max(prefill_fixed - 2 * hop, 0.0),
        "decode_step_base_s": step1, "decode_step_per_seq_s": max((step8 - step1) / 7, 0.0),
        "link_bytes_per_s": 1 / max(link_s_per_byte, 1e-12), "link_latency_s": max(link_latency, 0.0),
        "block_size": args.block_size, "block_bytes": int(num_bytes / max(num_blocks, 1)), "num_blocks": 2048,
        "router_hop_s": hop,
    }
    out_path = ROOT / "bench" / "results" / f"profile-{args.model}.json"
    out_path.write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps(profile, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
