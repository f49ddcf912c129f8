"""A burst of long prompts on a real CPU cluster that follows the SLO planner (issue 43):
`tandem up --prefill 1 --decode 1 --autoscale --max-prefill 2 --max-decode 2`, SmolLM2, the
router's default SLOs and planner settings.

    .venv/bin/python bench/autoscale_burst.py               # about 8 minutes
    .venv/bin/python bench/autoscale_burst.py --burst-s 60 --after-s 240

Three phases, one client throughout: a light chat load (a short prompt every --light-every-s
seconds) for --warm-s; then --burst-clients clients each sending long prompts (~--burst-words
words, each distinct, so nothing is cached) back to back for --burst-s, over the light load; then
the light load alone until the live prefill workers are back to one and --settle-s more, or
--after-s have passed. Every second it reads the router's /metrics: the live workers by role
(`tandem_live_workers`), the planner's `tandem_planner_desired_replicas` per pool and the
other `tandem_planner_*` series (its inputs).

Writes bench/results/autoscale_burst.json (--out): the timeline, each request's status and time
to first token (streamed), the most live prefill workers, when the second one went live after
the burst began, when the pool was back to one after it ended, and the failed requests (any
answer but 200, or an error mid-stream).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from fork import text  # noqa: E402
from provenance import write_result  # noqa: E402

from testing.metrics import scrape, series_sum  # noqa: E402
from testing.processes import free_port, stop_process  # noqa: E402
from testing.redis_server import REDIS_URL  # noqa: E402


class Load:
    """Chat requests from one thread per client until stopped; each one's outcome recorded."""

    def __init__(self, url: str, model: str, t0: float) -> None:
        self.url, self.model, self.t0 = url, model, t0
        self.requests: list[dict] = []
        self._lock = threading.Lock()

    def one(self, client: httpx.Client, kind: str, content: str, max_tokens: int) -> None:
        start = time.perf_counter()
        row = {"kind": kind, "t_s": round(start - self.t0, 2), "status": None, "ttft_s": None}
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                row["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        row["error"] = chunk["error"].get("message", "error")[:200]
                    elif row["ttft_s"] is None and chunk.get("choices"):
                        row["ttft_s"] = round(time.perf_counter() - start, 3)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        row["total_s"] = round(time.perf_counter() - start, 3)
        with self._lock:
            self.requests.append(row)

    def client(self, kind: str, stop: threading.Event, make, every_s: float, max_tokens: int):
        def run() -> None:
            with httpx.Client(base_url=self.url, timeout=600) as client:
                i = 0
                while not stop.is_set():
                    began = time.monotonic()
                    self.one(client, kind, make(i), max_tokens)
                    i += 1
                    stop.wait(max(0.0, every_s - (time.monotonic() - began)))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def sample(client: httpx.Client, t0: float) -> dict:
    metrics = scrape(client)
    return {"t_s": round(time.perf_counter() - t0, 1),
            "live_prefill": series_sum(metrics, "tandem_live_workers", role="prefill"),
            "live_decode": series_sum(metrics, "tandem_live_workers", role="decode"),
            "desired_prefill": series_sum(metrics, "tandem_planner_desired_replicas",
                                          pool="prefill"),
            "desired_decode": series_sum(metrics, "tandem_planner_desired_replicas",
                                         pool="decode"),
            # What the planner's decisions rest on (its inputs and fitted decode step).
            "planner": {k: v for k, v in metrics.items() if k.startswith("tandem_planner_")
                        and not k.startswith("tandem_planner_desired_replicas")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--warm-s", type=float, default=40)
    ap.add_argument("--burst-s", type=float, default=120)
    ap.add_argument("--after-s", type=float, default=420, help="most time after the burst")
    ap.add_argument("--settle-s", type=float, default=30, help="light load once back to one")
    ap.add_argument("--burst-clients", type=int, default=4)
    ap.add_argument("--burst-words", type=int, default=900)
    ap.add_argument("--light-every-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "autoscale_burst.json"))
    args = ap.parse_args()

    port, ns = free_port(), f"bench-autoscale-{uuid.uuid4().hex[:6]}"
    logs = Path(f"/tmp/{ns}")
    logs.mkdir()
    command = [str(Path(sys.executable).parent / "tandem"), "up", "--model", args.model,
               "--port", str(port), "--redis-url", REDIS_URL, "--namespace", ns,
               "--prefill", "1", "--decode", "1", "--autoscale", "--max-prefill", "2",
               "--max-decode", "2"]
    log = (logs / "up.log").open("w")
    up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    timeline: list[dict] = []
    try:
        with httpx.Client(base_url=url, timeout=10) as probe:
            deadline = time.monotonic() + 300
            while True:
                if up.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tandem up did not come up; see {logs / 'up.log'}")
                try:
                    if probe.get("/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            t0 = time.perf_counter()
            load = Load(url, args.model, t0)
            rng = random.Random(args.seed)
            light_stop, burst_stop = threading.Event(), threading.Event()
            threads = [load.client("light", light_stop, lambda i: f"Say hello, number {i}.",
                                   args.light_every_s, 16)]

            def watch(until) -> None:
                while not until():
                    timeline.append(sample(probe, t0))
                    time.sleep(1)

            watch(lambda: time.perf_counter() - t0 >= args.warm_s)
            burst_t = time.perf_counter() - t0
            for c in range(args.burst_clients):
                threads.append(load.client(
                    "burst", burst_stop,
                    lambda i, c=c: f"Document {c}-{i}: {text(rng, args.burst_words)} Summarize.",
                    0.0, 8))
            watch(lambda: time.perf_counter() - t0 >= burst_t + args.burst_s)
            burst_stop.set()
            burst_end_t = time.perf_counter() - t0
            back: list[float] = []  # when the prefill pool was last seen back at one

            def settled() -> bool:
                now = time.perf_counter() - t0
                if now >= burst_end_t + args.after_s:
                    return True
                last = timeline[-1]
                if last["live_prefill"] > 1 or not any(s["live_prefill"] > 1 for s in timeline):
                    back.clear()  # not scaled up yet, or up again
                    return False
                if not back:
                    back.append(last["t_s"])
                return now >= back[0] + args.settle_s

            watch(settled)
            light_stop.set()
            for t in threads:
                t.join(700)
    finally:
        stop_process(up, 120)
        log.close()
    up_log = (logs / "up.log").read_text()
    events = [line for line in up_log.splitlines() if "autoscale:" in line]
    failures = [r for r in load.requests if r["status"] != 200 or "error" in r]
    second_up = next((s["t_s"] for s in timeline
                      if s["t_s"] >= burst_t and s["live_prefill"] >= 2), None)
    back_to_one = back[0] if back else None
    burst = [r["ttft_s"] for r in load.requests if r["kind"] == "burst" and r["ttft_s"]]
    max_live = max(s["live_prefill"] for s in timeline)
    result = {
        "model": args.model, "config": vars(args), "command": " ".join(command[1:]),
        "burst_start_s": round(burst_t, 1), "burst_end_s": round(burst_end_t, 1),
        "max_live_prefill": max_live,
        "second_prefill_live_after_burst_start_s":
            round(second_up - burst_t, 1) if second_up is not None else None,
        "back_to_one_after_burst_end_s":
            round(back_to_one - burst_end_t, 1) if back_to_one is not None else None,
        "requests": len(load.requests), "failed_requests": len(failures),
        "burst_requests": len(burst),
        "burst_ttft_p50_s": sorted(burst)[len(burst) // 2] if burst else None,
        "autoscaler_events": events, "failures": failures[:20], "timeline": timeline,
        "request_log": load.requests,
        "goals": {"prefill_scaled_above_one": max_live > 1,
                  "back_to_one_within_5_min": back_to_one is not None
                  and back_to_one - burst_end_t <= 300,
                  "no_failed_request": not failures}}
    write_result(args.out, result)
    print(f"max live prefill {result['max_live_prefill']}; second live "
          f"{result['second_prefill_live_after_burst_start_s']} s after the burst began; back "
          f"to one {result['back_to_one_after_burst_end_s']} s after it ended; "
          f"{len(load.requests)} requests, {len(failures)} failed")
    for e in events:
        print(e)


if __name__ == "__main__":
    main()
