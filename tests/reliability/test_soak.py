"""Soak: a steady open-loop rate through the router for a fixed time, multi-turn chat with
streaming, on a real cluster (Redis, 1 prefill + 1 decode worker, router). Asserted: no request
fails, the memory of every process is flat after warm-up, and when the load stops every worker is
back to its baseline (no running or held requests, no leased or used blocks). `make test` runs
20 s (about 80 requests, five turns of each of the 16 conversations: a held request or a
leaked block shows at the end); the 60 s run is marked soak and run by hand (`pytest -m soak`), and
TANDEM_SOAK_SECONDS=600 makes it the 10-minute one."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import time
import uuid
from pathlib import Path

import openai
import pytest

from testing.cluster import Router, Worker
from testing.metrics import series_sum

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SHORT_SECONDS = 20.0  # make test
LONG_SECONDS = float(os.environ.get("TANDEM_SOAK_SECONDS", "60"))  # pytest -m soak
RATE = float(os.environ.get("TANDEM_SOAK_RATE", "4"))  # requests per second


def rss_mib(pid: int) -> float:
    """Resident memory of a service and its children (a worker's engine-core process)."""
    total = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1]) / 1024
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            total += rss_mib(int(child))
        except FileNotFoundError:  # exited meanwhile
            pass
    return total


def test_soak_steady_rate(tiny_folder, tmp_path):
    soak(tiny_folder, tmp_path, SHORT_SECONDS)


@pytest.mark.soak
def test_soak_steady_rate_long(tiny_folder, tmp_path):
    soak(tiny_folder, tmp_path, LONG_SECONDS)


def soak(tiny_folder, tmp_path, seconds: float) -> None:
    warmup = min(15.0, seconds / 4)
    ns = f"soak-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=tmp_path, namespace=ns, num_blocks=1024)
    d = Worker("decode", str(tiny_folder), cache_dir=tmp_path, namespace=ns, num_blocks=1024)
    r = Router(tiny_folder, ns, cache_dir=tmp_path)
    procs = {"router": r.proc.pid, "prefill": p.proc.pid, "decode": d.proc.pid}
    try:
        r.wait_workers(2)
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=60)
        rng = random.Random(0)
        # 16 conversations that grow turn by turn (and wrap around, so the caches keep churning).
        sessions = [[{"role": "system",
                      "content": f"Conversation {s}. " + "context " * rng.randint(5, 40)}]
                    for s in range(16)]

        def turn(k: int) -> str | None:
            msgs = list(sessions[k % len(sessions)])[-9:]
            msgs.append({"role": "user", "content": f"question {k}"})
            try:
                text = "".join(c.choices[0].delta.content or ""
                               for c in client.chat.completions.create(
                                   model="tiny-random", messages=msgs,
                                   max_tokens=rng.randint(4, 16), temperature=0.7, seed=k,
                                   stream=True) if c.choices)
            except openai.APIError as e:
                return f"{type(e).__name__}: {e}"
            sessions[k % len(sessions)] += [msgs[-1], {"role": "assistant", "content": text}]
            return None

        futures, baseline = [], None
        start = time.monotonic()
        with cf.ThreadPoolExecutor(16) as pool:
            k = 0
            while (now := time.monotonic() - start) < seconds:
                if baseline is None and now >= warmup:
                    baseline = {name: rss_mib(pid) for name, pid in procs.items()}
                # Open loop: arrivals on a Poisson clock, whatever the latency.
                futures.append(pool.submit(turn, k))
                k += 1
                time.sleep(rng.expovariate(RATE))
            errors = [e for f in futures if (e := f.result(timeout=120))]
        end = {name: rss_mib(pid) for name, pid in procs.items()}
        growth = {name: end[name] - baseline[name] for name in procs}
        print(f"soak: {len(futures)} requests in {seconds:.0f} s, {len(errors)} errors; "
              f"RSS MiB baseline {baseline} end {end}")
        assert not errors, errors[:5]
        assert len(futures) >= seconds * RATE * 0.6
        for name, g in growth.items():
            assert g < max(48.0, 0.15 * baseline[name]), (name, baseline[name], end[name])
        for w in (p, d):
            deadline = time.monotonic() + 30
            while True:
                s = w.metrics()
                if (s["tandem_worker_running_requests"] == 0
                        and s["tandem_worker_held_requests"] == 0
                        and s["tandem_worker_kv_usage"] == 0
                        and s.get("tandem_kv_leased_blocks", 0) == 0):
                    break
                assert time.monotonic() < deadline, (w.role, s)
                time.sleep(0.2)
        m = r.metrics()
        assert series_sum(m, "tandem_requests_total", status="200") == len(futures)
    finally:
        r.close()
        p.close()
        d.close()
