"""A decode worker drained under streaming load hands its streams over (issue 42, docs/contract.md
"Drain hand-off"): real prefill and decode workers and a router over Redis, tiny-random. Six
long greedy streams run; the decode worker with the most of them gets SIGTERM. Every stream
ends with the text of one uninterrupted engine; each one it ran resumed on the other decode
worker, which pulled every token the drained worker held (prompt and tokens so far) instead of
recomputing it; the drained worker exits 0 well within its drain timeout; nothing stays leased."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import httpx
import pytest

from engine import SamplingParams
from testing.cluster import Router, Worker
from tests.polling import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NUM_STREAMS = 6
MAX_TOKENS = 200


def running(w: Worker) -> float:
    return w.metrics().get("tandem_worker_running_requests", 0.0)


def test_a_drained_decode_worker_hands_its_streams_over(tiny_folder, tmp_path, reference):
    workdir, namespace = tmp_path, f"handoff-{uuid.uuid4().hex[:6]}"
    extra = ["--drain-timeout-s", "30"]
    p = Worker("prefill", str(tiny_folder), cache_dir=workdir, namespace=namespace, extra=extra)
    ds = [Worker("decode", str(tiny_folder), cache_dir=workdir, namespace=namespace,
                 num_blocks=1024, extra=extra) for _ in range(2)]
    r = None
    try:
        r = Router(tiny_folder, namespace, cache_dir=workdir)
        r.wait_workers(3)
        client = httpx.Client(base_url=r.url, timeout=120)
        # Distinct from their first block: the other decode worker holds none of them.
        prompts = [f"{i * 7919} stream: " + " ".join(f"word{(i * 37 + j) % 101}"
                                                     for j in range(40))
                   for i in range(NUM_STREAMS)]
        results: dict[int, dict] = {}

        def ask(i: int) -> None:
            got = client.post("/v1/completions", json={
                "model": "tiny-random", "prompt": prompts[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            results[i] = {"status": got.status_code, "body": got.json()}

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        wait_for(lambda: sum(running(d) for d in ds) >= NUM_STREAMS, 30, "every stream decoding")
        drained = max(ds, key=running)
        on_drained = running(drained)
        assert on_drained >= 1
        t0 = time.monotonic()
        drained.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert drained.proc.wait(30) == 0
        assert time.monotonic() - t0 < 20  # handed off, not run to the end of a 30 s timeout
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        handed = 0
        for i, res in results.items():
            assert res["status"] == 200, res
            body = res["body"]
            assert body["choices"][0]["text"] == reference.generate(prompts[i], params)[0].text
            t = body["tandem"]
            if t["handoff_held_tokens"]:
                handed += 1
                assert t["resumed"] >= 1
                # Prompt and tokens so far came from the drained worker, not computed again.
                assert t["handoff_pulled_tokens"] + t["handoff_cached_tokens"] == (
                    t["handoff_held_tokens"]), t
                assert t["handoff_pulled_tokens"] > 0, t
                assert t["handoff_held_tokens"] >= body["usage"]["prompt_tokens"] - 4, t
        assert handed == on_drained
        survivor = next(d for d in ds if d is not drained)
        wait_for(lambda: all(w.metrics().get("tandem_kv_leased_blocks", 0) == 0
                             for w in (p, survivor)), 15, "every lease released")
    finally:
        if r is not None:
            r.close()
        for w in (*ds, p):
            w.close()
