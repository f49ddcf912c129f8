"""Faults while under load, on one real cluster (own Redis, 2 prefill + 3 decode workers, the
router), all on loopback, 80 greedy streams 4 at a time: kill -9 a decode worker that is streaming,
kill -9 a prefill worker, restart Redis, stall a decode worker (SIGSTOP, then SIGCONT). Every
request is greedy with a known answer (the in-process reference engine), so a token lost or repeated
anywhere shows up as a text mismatch. Counted: completed, failed with a clear error, resumed, tokens
lost or repeated (must be zero); afterwards every surviving worker is back to its baseline (no
running or held requests, no leased or used blocks)."""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import signal
import threading
import time
import uuid

import openai
import pytest

from engine import SamplingParams
from testing.cluster import Router, Worker
from testing.metrics import series_sum
from testing.redis_server import RedisServer
from tests.polling import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server not installed")]

NUM_REQUESTS = 80
MAX_TOKENS = 48  # long enough that a fault lands mid-stream


def test_faults_under_load_lose_and_repeat_no_token(tiny_folder, tmp_path, reference):
    srv = RedisServer(tmp_path)
    ns = f"faults-{uuid.uuid4().hex[:6]}"
    args = ["--redis-url", srv.url, "--namespace", ns]
    prefill = [Worker("prefill", str(tiny_folder), cache_dir=tmp_path, extra=args)
               for _ in range(2)]
    decode = [Worker("decode", str(tiny_folder), cache_dir=tmp_path, extra=args, num_blocks=512)
              for _ in range(3)]
    # Short timeouts so a stalled worker is routed around within the test's time.
    router = Router(tiny_folder, ns, cache_dir=tmp_path, redis_url=srv.url,
                    env={"TANDEM_ROUTER_STREAM_STALL_TIMEOUT_S": "2",
                         "TANDEM_ROUTER_PREFILL_TIMEOUT_S": "3"})
    stopped = None
    try:
        router.wait_workers(5)
        prompts = [f"request {i}: what happens when workers fail?" for i in range(NUM_REQUESTS)]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.text for o in reference.generate(prompts, params)]
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        done = 0
        lock = threading.Lock()

        def ask(i: int):
            nonlocal done
            try:
                text, usage = "", None
                for chunk in client.completions.create(
                        model="tiny-random", prompt=prompts[i], max_tokens=MAX_TOKENS,
                        temperature=0, stream=True, stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True}):
                    if chunk.choices:
                        text += chunk.choices[0].text
                    if chunk.usage:
                        usage = chunk.usage.completion_tokens
                return "ok", text, usage
            except openai.APIError as e:  # a clear OpenAI-format error is an allowed outcome
                return "error", f"{type(e).__name__}: {e}", None
            finally:
                with lock:
                    done += 1

        def wait_busy(workers: list[Worker]) -> Worker:
            """The first of `workers` seen with a stream running."""
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for w in workers:
                    if w.metrics()["tandem_worker_running_requests"] > 0:
                        return w
                time.sleep(0.02)
            raise AssertionError(f"no decode worker was streaming ({done} done; "
                                 f"{[(w.worker_id, w.metrics()) for w in workers]})")

        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(ask, i) for i in range(NUM_REQUESTS)]
            wait_for(lambda: done >= 4, 60, "the first requests")
            # 1. kill -9 a decode worker while it streams (whichever is streaming now).
            victim = wait_busy(decode)
            victim.kill()
            # 2. kill -9 a prefill worker.
            wait_for(lambda: done >= 10, 60, "more requests")
            prefill[0].kill()
            # 3. restart Redis (workers re-publish their block sets on reconnect).
            wait_for(lambda: done >= 16, 60, "more requests")
            srv.stop()
            time.sleep(1.0)
            srv.start()
            # 4. stall a streaming decode worker for longer than the router's stall timeout.
            wait_for(lambda: done >= 22, 60, "more requests")
            stopped = wait_busy([w for w in decode if w is not victim])
            stopped.proc.send_signal(signal.SIGSTOP)
            time.sleep(4.0)
            stopped.proc.send_signal(signal.SIGCONT)
            survivors = [w for w in decode if w is not victim]
            stopped = None
            results = [f.result(timeout=120) for f in futures]

        ok = [i for i, r in enumerate(results) if r[0] == "ok"]
        failed = [r[1] for r in results if r[0] == "error"]
        wrong = [i for i in ok if results[i][1] != expected[i] or results[i][2] != MAX_TOKENS]
        m = router.metrics()
        resumed = series_sum(m, "tandem_retries_total", kind="resume")
        print(f"faults under load: {len(ok)} completed, {len(failed)} failed, "
              f"{resumed:.0f} resumed, {len(wrong)} with tokens lost or repeated")
        assert not wrong, [(i, results[i][1], expected[i]) for i in wrong]
        assert not failed, failed
        assert resumed >= 1
        # Survivors back to baseline: nothing running, held, leased, or in use.
        for w in (prefill[1], *survivors):
            def idle(w=w):
                s = w.metrics()
                return (s["tandem_worker_running_requests"] == 0
                        and s["tandem_worker_held_requests"] == 0
                        and s["tandem_worker_kv_usage"] == 0
                        and s.get("tandem_kv_leased_blocks", 0) == 0)
            wait_for(idle, 40, f"{w.worker_id} to return to baseline")
        # The restarted Redis has every live worker's registration again.
        wait_for(lambda: len(router.client.get("/ready").json()["workers"]) == 3, 20,
                 "re-registration")
    finally:
        if stopped is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        router.close()
        for w in (*prefill, *decode):
            w.close()
        srv.stop()
