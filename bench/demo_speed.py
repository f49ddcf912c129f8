"""What a newcomer should expect of `tandem up` on a small CPU machine: the demo cluster (one
prefill and one decode worker of SmolLM2-135M, the router) answering one stream, then four at
once, for each `--threads` setting asked for.

    .venv/bin/python bench/demo_speed.py [--threads 1,2] [--out bench/results/demo_speed.json]

Each setting starts its own `tandem up` (no Redis: static workers), warms it up, then sends
greedy chat requests of 128 new tokens (`ignore_eos`). Reported per setting: time to first
token and decode tokens/s of one stream (medians of 3), and the output tokens/s of 4 streams at
once. JSON with provenance; figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from testing.processes import wait_http_ok  # noqa: E402

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 128


def one(url: str, i: int) -> dict:
    body = {"model": MODEL, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": f"Tell me a story, {i}."}]}
    t0 = time.perf_counter()
    first = None
    num = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                num += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": first - t0, "decode_tok_s": (NEW_TOKENS - 1) / (end - first),
            "seconds": end - t0, "chunks": num}


def run(threads: int, port: int) -> dict:
    log = open(ROOT / "bench" / "results" / f"demo-speed-up-{threads}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--no-redis", "--port",
                             str(port), "--threads", str(threads)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(proc, Path(log.name), lambda: httpx.get(f"{url}/ready", timeout=2),
                     "tandem up", timeout=300, interval=0.5)
        one(url, -1)  # warm-up
        single = [one(url, i) for i in range(3)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            four = list(pool.map(lambda i: one(url, 100 + i), range(4)))
        wall = time.perf_counter() - t0
        return {"threads_per_worker": threads,
                "one_stream": {"ttft_s": round(statistics.median(x["ttft_s"] for x in single), 3),
                               "decode_tok_s": round(statistics.median(
                                   x["decode_tok_s"] for x in single), 1)},
                "four_streams": {"output_tok_s": round(4 * NEW_TOKENS / wall, 1),
                                 "ttft_s_max": round(max(x["ttft_s"] for x in four), 3)}}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2", help="torch threads per worker, comma-separated")
    ap.add_argument("--port", type=int, default=8127)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "demo_speed.json"))
    args = ap.parse_args()
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    rows = []
    for t in (int(x) for x in args.threads.split(",")):
        rows.append(run(t, args.port))
        print(rows[-1], flush=True)
    result = {"cores": os.cpu_count(), "new_tokens": NEW_TOKENS, "runs": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
