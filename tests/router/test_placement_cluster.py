"""Placement under cache pressure (issue 42) on real processes: a router over two colocated
workers with small KV caches, found through Redis, each worker reporting its headroom in its
heartbeat. New conversations' first turns, one after the other, split evenly; after one worker
restarts empty, new conversations go to it, since a placement on the full one evicts, while a
follow-up stays with the worker that holds its prefix.

A heartbeat taken while a turn runs reports it running or queued until the next heartbeat, and
the policy rightly avoids a busy worker: so each turn waits until the worker that served the one
before has reported it done (equal load), and what decides is the caches. Turns sent faster than
reports come (the router counts what it sent until a report shows it) are
tests/router/test_placement.py's `test_placements_count_against_a_lagging_report`."""

from __future__ import annotations

import json
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from common.registry import RedisKeys
from testing.cluster import Router, Worker
from testing.redis_server import REDIS_URL
from tests.polling import wait_for

pytestmark = pytest.mark.redis

NUM_BLOCKS = 48  # of 4 tokens: four first turns of 40 tokens (+ the answer) fill 44 of them
PROMPT_TOKENS = 40
REFRESH_S = 0.1  # the router's --refresh-interval-s: how soon it reads a new report
TTL_S = 2.0  # the workers' --heartbeat-ttl: a report every 2/3 s
WAIT_S = 30.0  # a guard against hanging, never a condition


def complete(router: Router, prompt: list[int]) -> dict:
    r = router.client.post("/v1/completions", timeout=WAIT_S, json={
        "model": "tiny-random", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["tandem"]


def live_workers(router: Router) -> set[str]:
    return set(router.client.get("/ready").json()["workers"])


def test_new_conversations_split_and_follow_an_empty_worker(tiny_folder, tmp_path):
    ns = f"place-{uuid.uuid4().hex[:6]}"
    keys, rd = RedisKeys(ns), redis.Redis.from_url(REDIS_URL)

    def load(w: Worker) -> dict | None:
        raw = rd.hget(keys.worker(w.worker_id), "load")
        return json.loads(raw) if raw else None

    def reported_done(w: Worker, before: dict | None) -> bool:
        """`w` published a report since `before` with nothing running or queued."""
        now = load(w)
        return now is not None and now != before and now["running"] == now["waiting"] == 0

    with ThreadPoolExecutor(3) as pool:  # the three processes start side by side
        starts = [pool.submit(Worker, "colocated", str(tiny_folder), cache_dir=tmp_path,
                              namespace=ns, num_blocks=NUM_BLOCKS, ttl=TTL_S) for _ in range(2)]
        starts.append(pool.submit(Router, tiny_folder, ns, cache_dir=tmp_path, extra=[
            "--expose-worker-ids", "--refresh-interval-s", str(REFRESH_S)]))
    *workers, router = [f.result() for f in starts]
    try:
        router.wait_workers(2)
        rng = random.Random(42)
        convs = [[rng.randrange(4, 250) for _ in range(PROMPT_TOKENS)] for _ in range(8)]

        def turn(prompt: list[int]) -> str:
            """The worker that served `prompt`, once it has reported the turn done."""
            before = {w.worker_id: load(w) for w in workers}
            wid = complete(router, prompt)["decode_worker"]
            w = next(w for w in workers if w.worker_id == wid)
            wait_for(lambda: reported_done(w, before[wid]), WAIT_S, "a report of the turn")
            time.sleep(3 * REFRESH_S)  # ... read by the router
            return wid

        homes = [turn(p) for p in convs]
        counts = sorted(homes.count(w.worker_id) for w in workers)
        print("first turns of 8 conversations:", counts, homes)
        assert sum(counts) == 8 and counts[0] >= 3, homes

        # The worker with fewer conversations restarts empty (same id, as a restarted pod on the
        # same address); the other holds four or more of 40 tokens: a new one evicts there.
        gone, kept_on = sorted(workers, key=lambda w: homes.count(w.worker_id))
        gone.kill()
        wait_for(lambda: gone.worker_id not in live_workers(router), WAIT_S,
                 "the router to drop the dead worker (its registration expires)")
        gone.restart()
        wait_for(lambda: len(live_workers(router)) == 2, WAIT_S, "the router to see it again")
        after = [turn([rng.randrange(4, 250) for _ in range(PROMPT_TOKENS)]) for _ in range(4)]
        print("new conversations after the restart:", after, "restarted:", gone.worker_id)
        assert after == [gone.worker_id] * 4
        # A follow-up of a conversation the other worker still holds stays there (the last one
        # it took: a least recently used one may have been evicted).
        kept = [p for p, home in zip(convs, homes, strict=True) if home == kept_on.worker_id][-1]
        trace = complete(router, kept + [7, 8, 9, 10])
        assert trace["decode_worker"] == kept_on.worker_id, trace
        assert trace["num_cached_tokens"] >= PROMPT_TOKENS - 4, trace
    finally:
        rd.close()
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: p.close(), [router, *workers]))
