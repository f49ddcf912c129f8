"""How fast the router answers /health while clients post multi-megabyte bodies.

    .venv/bin/python bench/abuse.py [--clients 8] [--seconds 10]

A `tandem router` with SmolLM2's tokenizer (no workers are needed: every abusive request ends in
a 400 before routing) is probed with GET /health at 20/s for `--seconds`, first idle, then while
`--clients` threads post, back to back:
  4mib      4 MiB of text: refused by the byte-length pre-check, never tokenized
  1mib      1 MiB of text (under the pre-check's bound): tokenized off the event loop, then 400
  1mib-loop the same with tokenizing on the event loop (TANDEM_ROUTER_OFFLOAD_CHARS=10**12:
            what the router did before), the baseline the off-loop path is compared with
  tools-3.6mib  chat requests with 3.6 MiB of `tools` (128 tools of ~28 KiB), through the
            tool-aware template: refused by the pre-check, which counts what the template reads
  tools-1mib    the same with 40 tools (1.1 MiB, under the pre-check's bound): rendered and
            tokenized off the event loop, then refused on their token count
Each case runs on a fresh router. JSON: bench/results/abuse.json (p50/p99 of /health in ms,
ratios against the idle run, abusive requests answered, provenance).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from engine.model_store import prepare_smollm2  # noqa: E402
from testing.cluster import Router  # noqa: E402 - the same process helper as the tests

CASES = {"4mib": (4 << 20) - 4096, "1mib": 1 << 20, "1mib-loop": 1 << 20,
         "tools-3.6mib": 128, "tools-1mib": 40}
TEMPLATE = ROOT / "templates" / "chatml_tools.jinja"


def tools_body(model: str, num_tools: int) -> tuple[str, str]:
    """(path, body): a chat request with `num_tools` tools of ~28 KiB of word-like text each
    (the bounds allow 128 of 16 KiB descriptions plus free-form parameters)."""
    rng = random.Random(num_tools)
    vocab = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9)))
             for _ in range(500)]

    def words(n: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(n // 6))[:n]

    desc, param = words(16000), words(2000)
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": desc, "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": param} for j in range(6)}}}}
        for i in range(num_tools)]
    return "/v1/chat/completions", json.dumps({
        "model": model, "max_tokens": 4, "tools": tools,
        "messages": [{"role": "user", "content": "What is the weather?"}]})


def probe(url: str, seconds: float, rate: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            out.append((time.perf_counter() - t0) * 1000)
            time.sleep(max(0.0, 1 / rate - out[-1] / 1000))
    return out


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 2), "p99_ms": round(q[98], 2), "max_ms": round(max(ms), 2)}


def abusers(url: str, body: str, clients: int, stop, out) -> None:
    """`clients` threads posting `body` back to back until `stop`; their statuses go to `out`."""
    answered: list[int] = []

    def abuse() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                answered.append(client.post(url, content=body, headers={
                    "Content-Type": "application/json"}).status_code)

    threads = [threading.Thread(target=abuse) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(answered)


def run_case(folder: Path, work: Path, name: str | None, clients: int, seconds: float) -> dict:
    env = {"TANDEM_ROUTER_OFFLOAD_CHARS": str(10**12)} if name and name.endswith("-loop") else {}
    size = CASES[name] if name else None
    router = Router(folder, None, cache_dir=work, redis_url=None, block_size=16,
                    extra=["--worker", "decode=http://127.0.0.1:1", "--chat-template",
                           str(TEMPLATE)],
                    env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if router.client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.2)
        if name and name.startswith("tools"):
            path, body = tools_body(folder.name, size)
        else:
            path, body = "/v1/completions", json.dumps(
                {"model": folder.name, "prompt": "abc " * ((size or 0) // 4), "max_tokens": 4})
        # The abusers run in a process of their own: threads beside the probe would share its
        # interpreter, and their GIL would be counted as the router's latency.
        mp = multiprocessing.get_context("spawn")
        stop, out = mp.Event(), mp.Queue()
        proc = mp.Process(target=abusers, args=(f"{router.url}{path}", body,
                                                clients if size else 0, stop, out))
        proc.start()
        time.sleep(3.0 if size else 0)  # the process has started and its clients are posting
        t0 = time.monotonic()
        ms = probe(router.url, seconds, 20.0)
        elapsed = time.monotonic() - t0
        stop.set()
        answered = out.get(timeout=120)
        proc.join(30)
        return {**summary(ms), "probes": len(ms), "abusive_requests": len(answered),
                "abusive_per_s": round(len(answered) / elapsed, 1),
                "abusive_statuses": sorted(set(answered))}
    finally:
        router.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0, help="probing time per case")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "abuse.json"))
    ap.add_argument("--cases", default=",".join(CASES), help="which, comma-separated")
    args = ap.parse_args()
    folder = prepare_smollm2()
    work = Path(args.out).parent
    work.mkdir(parents=True, exist_ok=True)
    result = {"clients": args.clients, "seconds": args.seconds,
              "idle": run_case(folder, work, None, args.clients, args.seconds)}
    for name in args.cases.split(","):
        result[name] = run_case(folder, work, name, args.clients, args.seconds)
        for q in ("p50_ms", "p99_ms"):
            result[name][f"{q[:3]}_vs_idle"] = round(result[name][q] / result["idle"][q], 2)
        print(name, result[name], flush=True)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
