"""A 64-worker fleet on this machine: 16 prefill and 48 decode tiny-random workers (small KV, one
torch thread each, eight per process: testing/worker_pack.py) behind two router replicas sharing
one local Redis Cluster. Both routers see the whole fleet, route each repeated prompt to the
worker that holds its prefix whichever router served it first, answer exactly as the reference
engine does, and when a process with eight workers is killed, requests keep succeeding and both
routers drop the dead workers."""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from engine import SamplingParams
from testing.cluster import TOKEN, Router
from testing.processes import ROOT
from testing.redis_cluster import LocalRedisCluster

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server not installed")]

PACKS = [("prefill", 8)] * 2 + [("decode", 8)] * 6


def _pack(role: str, count: int, folder: Path, url: str, ns: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "testing.worker_pack", "--count", str(count), role,
           "--model", str(folder), "--port", "0", "--num-blocks", "512", "--block-size", "4",
           "--threads", "1", "--redis-url", url, "--redis-cluster", "--namespace", ns,
           f"--internal-token={TOKEN}", "--heartbeat-ttl", "3", "--cache-dir", str(log.parent)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _ask(router: Router, prompt: str) -> dict:
    r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                   json={"model": "tiny-random", "prompt": prompt, "max_tokens": 6,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _num_workers(router: Router) -> int:
    return len(router.client.get("/ready").json()["workers"])


def test_64_workers_behind_two_routers_on_a_redis_cluster(tiny_folder, tmp_path, reference):
    cluster = LocalRedisCluster(tmp_path / "redis")
    ns = f"fleet-{uuid.uuid4().hex[:6]}"
    packs, routers = [], []
    try:
        packs = [_pack(role, n, tiny_folder, cluster.url, ns, tmp_path / f"pack-{i}.log")
                 for i, (role, n) in enumerate(PACKS)]
        for _ in range(2):
            routers.append(Router(tiny_folder, ns, cache_dir=tmp_path, redis_url=cluster.url,
                                  extra=["--redis-cluster"]))
        for r in routers:
            r.wait_workers(64, timeout=240)

        prompts = [f"{i:02d} fleet session {i} asks about its own long shared context " * 2
                   for i in range(24)]
        params = SamplingParams(temperature=0, max_tokens=6)
        want = [o.text for o in reference.generate(prompts, params)]
        # Eight at a time, so the load spreads the sessions over the fleet.
        with cf.ThreadPoolExecutor(8) as pool:
            first = list(pool.map(lambda i: _ask(routers[i % 2], prompts[i]), range(len(prompts))))
        time.sleep(1.0)  # block events reach both routers' replicas
        again = [_ask(routers[(i + 1) % 2], p) for i, p in enumerate(prompts)]
        assert [o["choices"][0]["text"] for o in first] == want
        assert [o["choices"][0]["text"] for o in again] == want
        assert all(o["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for o in first)
        hits = [(o["usage"]["prompt_tokens_details"]["cached_tokens"], o["tandem"]["plan"])
                for o in again]
        stats = [r.client.get("/ready").json()["index"] for r in routers]
        # The other router knew where each prefix was, on whichever of the workers it is.
        assert all(cached > 0 for cached, _ in hits), (hits, stats)
        assert all(s["workers"] >= 8 and s["gaps"] == 0 for s in stats), stats

        # Eight decode workers die at once: requests keep succeeding; both routers drop them.
        packs[-1].send_signal(signal.SIGKILL)
        packs[-1].wait(10)
        answers = [_ask(routers[i % 2], f"after the crash {i}") for i in range(12)]
        assert all(a["choices"] for a in answers)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_num_workers(r) != 56 for r in routers):
            time.sleep(0.2)
        assert [_num_workers(r) for r in routers] == [56, 56]
    finally:
        for r in routers:
            r.close()
        for p in packs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in packs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.close()
