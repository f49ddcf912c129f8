"""Failures under the router: a decode worker killed mid-stream, a prefill worker killed, Redis
stopped under load; and kv_aware against round_robin on multi-turn traffic."""

import concurrent.futures as cf
import shutil
import time
import uuid

import openai
import pytest

from engine import SamplingParams
from testing.cluster import Router, Worker
from testing.metrics import series_sum
from testing.redis_server import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("failures")


def client_for(r: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_killed_decode_mid_stream_resumes_with_identical_greedy_text(
        tiny_folder, workdir, reference):
    ns = f"kd-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=workdir, namespace=ns)
    d1 = Worker("decode", str(tiny_folder), cache_dir=workdir, namespace=ns, num_blocks=512)
    d2 = Worker("decode", str(tiny_folder), cache_dir=workdir, namespace=ns, num_blocks=512)
    r = Router(tiny_folder, ns, cache_dir=workdir)
    try:
        r.wait_workers(3)
        prompt = "A long story begins here"
        want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=300,
                                                         ignore_eos=True))[0]
        stream = client_for(r).completions.create(model="tiny-random", prompt=prompt,
                                                  max_tokens=300, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        text, killed = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if killed is None and len(text) > 20:
                # Kill whichever decode worker is streaming this request.
                busy = [w for w in (d1, d2) if w.metrics()["tandem_worker_running_requests"] > 0]
                killed = busy[0]
                killed.kill()
        assert killed is not None
        assert text == want.text
        m = r.metrics()
        assert series_sum(m, "tandem_retries_total", kind="resume") >= 1
    finally:
        r.close()
        for w in (p, d1, d2):
            w.close()


def test_killed_prefill_worker_requests_keep_succeeding(tiny_folder, workdir, reference):
    ns = f"kp-{uuid.uuid4().hex[:6]}"
    p1 = Worker("prefill", str(tiny_folder), cache_dir=workdir, namespace=ns)
    p2 = Worker("prefill", str(tiny_folder), cache_dir=workdir, namespace=ns)
    d = Worker("decode", str(tiny_folder), cache_dir=workdir, namespace=ns)
    r = Router(tiny_folder, ns, cache_dir=workdir, policy="round_robin")
    try:
        r.wait_workers(3)
        c = client_for(r)
        prompts = [f"question number {i} about routing" for i in range(12)]

        def ask(prompt):
            return c.completions.create(model="tiny-random", prompt=prompt, max_tokens=8,
                                        temperature=0).choices[0].text

        assert ask(prompts[0]) == reference.generate(
            prompts[0], SamplingParams(temperature=0, max_tokens=8))[0].text
        p1.kill()
        results = [ask(q) for q in prompts]  # the dead worker is still in Redis for up to its TTL
        for q, got in zip(prompts, results, strict=True):
            assert got == reference.generate(q, SamplingParams(temperature=0, max_tokens=8))[0].text
    finally:
        r.close()
        for w in (p1, p2, d):
            w.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_stopping_redis_under_load_fails_no_request(tiny_folder, workdir, tmp_path):
    server = RedisServer(tmp_path)
    url = server.url
    ns = f"rd-{uuid.uuid4().hex[:6]}"
    p = Worker("prefill", str(tiny_folder), cache_dir=workdir, token="t",
               extra=["--redis-url", url, "--namespace", ns])
    d = Worker("decode", str(tiny_folder), cache_dir=workdir, token="t",
               extra=["--redis-url", url, "--namespace", ns])
    r = Router(tiny_folder, ns, cache_dir=workdir, redis_url=url, token="t")
    try:
        r.wait_workers(2)
        c = client_for(r)

        def ask(i):
            return c.completions.create(model="tiny-random", prompt=f"load {i}", max_tokens=6,
                                        temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].finish_reason

        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(ask, i) for i in range(120)]
            time.sleep(0.3)
            server.stop()
            results = [f.result() for f in futures]
        assert results == ["length"] * 120
        assert r.metrics()["tandem_redis_up"] == 0  # it really routed without Redis
        assert ask(999) == "length"
    finally:
        r.close()
        p.close()
        d.close()
        server.stop()


def _multi_turn_hit_ratio(tiny_folder, workdir, ns: str, policy: str) -> float:
    """The prefix hit ratio of a fresh router with `policy` over the workers of `ns`, on
    conversations of its own (their first block names the policy: nothing another policy's run
    left in the caches matches them)."""
    r = Router(tiny_folder, ns, cache_dir=workdir, policy=policy,
               extra=[])
    try:
        r.wait_workers(3)
        c = client_for(r)
        # Three sessions (odd): round robin cannot stick a session to one prefill worker by luck.
        sessions = [[{"role": "system", "content": f"{policy} {s}: " + "context " * 20}]
                    for s in range(3)]
        for turn in range(4):
            for msgs in sessions:
                msgs.append({"role": "user", "content": f"turn {turn} question"})
                out = c.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=4,
                                                temperature=0)
                msgs.append({"role": "assistant", "content": out.choices[0].message.content})
                time.sleep(0.05)
        m = r.metrics()
        hits = sum(v for k, v in m.items() if k.startswith("tandem_prefix_cache_hit_tokens_total"))
        return hits / series_sum(m, "tandem_prompt_tokens_total")
    finally:
        r.close()


def test_kv_aware_hit_ratio_beats_round_robin_on_multi_turn(tiny_folder, workdir):
    # One set of workers for both routers (kv_aware first: round robin then finds the chat
    # template's shared head cached, which only helps it).
    ns = f"mt-{uuid.uuid4().hex[:6]}"
    ps = [Worker("prefill", str(tiny_folder), cache_dir=workdir, namespace=ns, num_blocks=1024)
          for _ in range(2)]
    d = Worker("decode", str(tiny_folder), cache_dir=workdir, namespace=ns, num_blocks=1024)
    try:
        kv = _multi_turn_hit_ratio(tiny_folder, workdir, ns, "kv_aware")
        rr = _multi_turn_hit_ratio(tiny_folder, workdir, ns, "round_robin")
    finally:
        for w in (*ps, d):
            w.close()
    print(f"multi-turn prefix hit ratio: kv_aware={kv:.3f} round_robin={rr:.3f}")
    assert kv > rr + 0.1, (kv, rr)
    assert kv > 0.5
